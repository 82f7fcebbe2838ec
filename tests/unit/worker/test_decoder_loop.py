"""The runner's own decoder loop (worker_svc/decoder_loop.py) gives the logits of Hugging Face's
forward bit for bit: prefill chunks beside decodes, float32 and bfloat16, q/k/v fused on AMX
and not (prefills past AMX_MAX_ROWS rows), and it is only built where it applies."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from common.messages import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from tests.cpu_levels import needs_level  # noqa: E402
from worker_svc import amx_gemm, decoder_loop, fused_ops  # noqa: E402
from worker_svc.config import ModelRunnerConfig  # noqa: E402
from worker_svc.fast_linear import AMX_MAX_ROWS  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
needs_ops = needs_level("avx512", "the fused ops")


class LogitsTap:
    """Wraps the runner's sampler and keeps a copy of every step's logits."""

    def __init__(self, runner: ModelRunner) -> None:
        self.inner, self.logits = runner.sampler, []
        runner.sampler = self

    def __call__(self, logits, metadata):
        self.logits.append(logits.clone())
        return self.inner(logits, metadata)


def run_steps(runner: ModelRunner, prompts: list[list[int]], chunk: int, decodes: int) -> list:
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


def assert_same_logits(runner: ModelRunner, prompts, chunk: int, decodes: int) -> None:
    loop = runner.decoder_loop
    assert loop is not None
    got = run_steps(runner, prompts, chunk, decodes)
    runner.decoder_loop = None  # the HF forward on the same modules
    try:
        want = run_steps(runner, prompts, chunk, decodes)
    finally:
        runner.decoder_loop = loop
    assert len(got) == len(want) > decodes
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


@needs_ops
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_are_the_hf_forwards_bits(tiny_llama_dir, dtype):
    runner = ModelRunner(
        ModelRunnerConfig(
            model=str(tiny_llama_dir), dtype=dtype, block_size=4, num_gpu_blocks=64, num_threads=2
        )
    )
    loop = runner.decoder_loop
    assert loop is not None and len(loop.layers) == 2
    # q/k/v are one AMX GEMM in bfloat16 where the CPU has AMX, never in float32
    fused = dtype == "bfloat16" and amx_gemm.load() is not None
    assert loop.fused_qkv == (2 if fused else 0)
    prompts = [[7, 99, 23, 300, 41, 5, 77, 8, 9], [3, 4, 5], [11] * 13, [200, 201]]
    assert_same_logits(runner, prompts, chunk=5, decodes=6)


@needs_ops
def test_not_built_where_it_does_not_apply(tiny_llama_dir):
    def runner(**kw):
        return ModelRunner(
            ModelRunnerConfig(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=16, **kw)
        )

    off = runner(decoder_loop=False)
    assert off.decoder_loop is None and off.forward_path == "hf"
    assert runner(fused_ops=False).decoder_loop is None  # HF's own RMSNorm modules
    r = runner()
    assert decoder_loop.build(r.model, None) is None
    r.model.config._attn_implementation = "sdpa"  # not the runner's paged attention
    assert decoder_loop.build(r.model, fused_ops.load()) is None


@pytest.mark.slow
@needs_ops
def test_smollm2_bfloat16_with_fused_qkv_and_long_prefills():
    """The real model: decode batches on the fused q/k/v GEMM, and a prefill chunk of more than
    AMX_MAX_ROWS tokens, where q, k and v run apart on oneDNN."""
    runner = ModelRunner(
        ModelRunnerConfig(model=None, dtype="bfloat16", num_gpu_blocks=256, num_threads=2)
    )
    if amx_gemm.load() is not None:
        assert runner.decoder_loop.fused_qkv == len(runner.decoder_loop.layers)
    long = [(i * 37) % 40000 + 100 for i in range(AMX_MAX_ROWS + 88)]
    prompts = [long, [1, 9690, 198, 6077, 5453], [504, 6508, 10637] * 20]
    assert_same_logits(runner, prompts, chunk=AMX_MAX_ROWS + 40, decodes=4)
