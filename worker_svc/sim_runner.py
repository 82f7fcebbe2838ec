"""A worker runner with no model: it answers each step after a modelled forward time.

For scale benchmarks and mechanics tests. Its "model" is deterministic: the next token is a
hash of the request's last tokens, so a run can be checked token for token against another
run, whatever the batching, preemption or migration.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from common.messages import SchedulerOutput
from common.model_source import resolve_model


def _opt(default, help_text: str):
    return field(default=default, metadata={"help": help_text})


@dataclass(slots=True)
class SimConfig:
    simulate: bool = _opt(False, "run a simulated model (no weights): for scale tests")
    sim_step_base_ms: float = _opt(5.0, "simulated forward time per step")
    sim_step_per_token_us: float = _opt(50.0, "simulated forward time per scheduled token")
    sim_num_blocks: int = _opt(4096, "simulated KV cache blocks")
    sim_vocab_size: int = _opt(49152, "simulated vocabulary size")


def sim_next_token(history: list[int], vocab_size: int) -> int:
    h = 0x9E3779B1
    for tok in history[-6:]:
        h = ((h ^ tok) * 0x01000193) & 0xFFFFFFFF
    return 3 + h % (vocab_size - 3)  # never 0..2 (special tokens, EOS)


@dataclass(slots=True)
class SimOutput:
    sampled_token_ids: dict[str, list[int]]
    logprobs: None = None
    forward_time_s: float = 0.0
    sample_time_s: float = 0.0


class SimRunner:
    def __init__(
        self,
        sim: SimConfig,
        model: str | None = None,
        block_size: int = 16,
        max_model_len: int = 8192,
    ) -> None:
        self.sim = sim
        self.model_name = resolve_model(model).name
        self.block_size = block_size
        self.num_blocks = sim.sim_num_blocks
        self.num_host_blocks = 0
        self.max_model_len = max_model_len
        self.vocab_size = sim.sim_vocab_size
        self.eos_token_id = 2
        self.device = "sim"
        self.dtype = "none"
        self.prompts: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}

    def reset(self) -> None:
        self.prompts.clear()
        self.tokens.clear()

    def execute_model(self, so: SchedulerOutput) -> SimOutput:
        started = time.perf_counter()
        for rid in so.finished_req_ids:
            self.prompts.pop(rid, None)
            self.tokens.pop(rid, None)
        computed: dict[str, int] = {}
        for new in so.new_requests:
            self.prompts[new.request_id] = list(new.prompt_token_ids)
            self.tokens[new.request_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            computed[new.request_id] = new.num_computed_tokens
        for cached in so.cached_requests:
            computed[cached.request_id] = cached.num_computed_tokens
            if cached.resumed:
                self.tokens[cached.request_id] = self.prompts[cached.request_id] + list(
                    cached.new_token_ids
                )
        sampled: dict[str, list[int]] = {}
        vocab = self.vocab_size
        for rid, n in so.num_scheduled_tokens.items():
            seq = self.tokens[rid]
            if computed[rid] + n >= len(seq):
                tok = sim_next_token(seq, vocab)
                seq.append(tok)
                sampled[rid] = [tok]
            else:
                sampled[rid] = []
        if so.total_num_scheduled_tokens:
            modelled = (
                self.sim.sim_step_base_ms / 1e3
                + so.total_num_scheduled_tokens * self.sim.sim_step_per_token_us / 1e6
            )
            remaining = modelled - (time.perf_counter() - started)
            if remaining > 0:
                time.sleep(remaining)
        return SimOutput(sampled, None, time.perf_counter() - started, 0.0)
