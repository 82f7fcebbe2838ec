"""Drive a ModelRunner through prefill chunks and decode steps and keep each step's logits (the
decode stack's and the quantization tests share it)."""

from __future__ import annotations

import torch

from common.messages import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from worker_svc.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0)


class LogitsTap:
    """Wraps the runner's sampler and keeps a copy of every step's logits."""

    def __init__(self, runner: ModelRunner) -> None:
        self.inner, self.logits = runner.sampler, []
        runner.sampler = self

    def __call__(self, logits, metadata):
        self.logits.append(logits.clone())
        return self.inner(logits, metadata)


def run_steps(
    runner: ModelRunner, prompts: list[list[int]], chunk: int, decodes: int
) -> list[torch.Tensor]:
    """Prefill every prompt in chunks of `chunk` tokens beside the decodes of the ones already
    prefilled, then `decodes` pure decode steps; returns each step's logits."""
    runner.reset()
    tap = LogitsTap(runner)
    try:
        bs = runner.block_size
        tokens = {f"r{i}": list(p) for i, p in enumerate(prompts)}
        computed = dict.fromkeys(tokens, 0)
        need = {r: -(-(len(p) + decodes + chunk) // bs) for r, p in tokens.items()}
        first = 0
        blocks = {}
        for r in tokens:
            blocks[r] = list(range(first, first + need[r]))
            first += need[r]
        sent: set[str] = set()
        while True:
            scheduled = {r: min(chunk, len(t) - computed[r]) for r, t in tokens.items()}
            scheduled = {r: n for r, n in scheduled.items() if n > 0}
            if not scheduled or all(
                len(tokens[r]) - len(prompts[int(r[1:])]) >= decodes for r in tokens
            ):
                break
            new = [
                NewRequestData(r, tokens[r], GREEDY, blocks[r], 0, [])
                for r in scheduled
                if r not in sent
            ]
            cached = [CachedRequestData(r, [], computed[r]) for r in scheduled if r in sent]
            so = SchedulerOutput(
                new_requests=new, cached_requests=cached, num_scheduled_tokens=scheduled
            )
            so.total_num_scheduled_tokens = sum(scheduled.values())
            out = runner.execute_model(so)
            sent.update(scheduled)
            for r, n in scheduled.items():
                computed[r] += n
                tokens[r] += out.sampled_token_ids[r]
        return tap.logits
    finally:
        runner.sampler = tap.inner
