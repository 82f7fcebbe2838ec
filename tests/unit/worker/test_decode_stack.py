"""The native decode stack (worker_svc/decode_stack.py, installed as the model's decode_step)
runs a pure-decode step's layers in one call and gives the model's Python layer loop's logits
bit for bit (decode_step set against decode_step=None on the same steps), in float32 and
bfloat16; steps with prefill chunks, steps under the profiler, and a stack switched off
(DecodeStack.enabled) keep the loop."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.cpu_levels import needs_level  # noqa: E402
from tests.unit.worker.runner_steps import run_steps  # noqa: E402
from worker_svc import native_attention, packed_gemm  # noqa: E402
from worker_svc.config import ModelRunnerConfig  # noqa: E402
from worker_svc.decode_stack import DecodeStack  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402


def _bf16_decode_body() -> bool:
    kernel = native_attention.load()
    return kernel is not None and kernel.bf16_dot


needs_stack = needs_level("amx", "the bfloat16 decode stack")
needs_f32_stack = needs_level("avx2", "the float32 decode stack")
DTYPES = [
    pytest.param("float32", marks=needs_f32_stack),
    pytest.param("bfloat16", marks=needs_stack),
]


def counted(stack):
    """`stack`, the steps it ran (not declined) counted in stack.calls from here on."""
    stack.calls = 0
    original = type(stack).__call__

    def call(self, *args):
        out = original(self, *args)
        self.calls += out is not None
        return out

    stack.__class__ = type("CountedStack", (type(stack),), {"__call__": call})
    return stack


def runner_for(path, dtype="bfloat16", blocks=512, block_size=4):
    return ModelRunner(
        ModelRunnerConfig(
            model=str(path),
            dtype=dtype,
            block_size=block_size,
            num_gpu_blocks=blocks,
            num_threads=2,
        )
    )


def stack_vs_loop(runner, prompts, chunk, decodes):
    """Each step's logits with the stack as the model's decode_step, then without it (the
    model's layer loop on the same ops), and how many steps the stack ran."""
    stack = runner.model.decode_step
    assert isinstance(stack, DecodeStack)
    stack.enabled = True
    before = getattr(stack, "calls", 0)
    got = run_steps(runner, prompts, chunk, decodes)
    used = getattr(stack, "calls", 0) - before
    runner.model.decode_step = None
    try:
        assert runner.forward_path == "model"
        want = run_steps(runner, prompts, chunk, decodes)
    finally:
        runner.model.decode_step = stack
    return got, want, used


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_steps_are_the_layer_loops_bits(llama_hd64_dir, dtype):
    runner = runner_for(llama_hd64_dir, dtype)
    assert runner.forward_path == "model+decode-stack"
    counted(runner.model.decode_step)
    # 37 rows: not a multiple of the GEMM's 32-row tiles; contexts over several 4-token blocks
    prompts = [[(i * 7 + j * 3) % 500 + 3 for j in range(2 + i % 11)] for i in range(37)]
    got, want, used = stack_vs_loop(runner, prompts, chunk=16, decodes=5)
    assert used == len(got) - 1 == 4  # every step but the prefill
    assert len(got) == len(want) and all(g.dtype == getattr(torch, dtype) for g in got)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reads_the_live_weights(llama_hd64_dir, dtype):
    """The stack reads the model's live (packed) weights: a change to one shows in its logits,
    undoing it restores them."""
    runner = runner_for(llama_hd64_dir, dtype)
    stack = counted(runner.model.decode_step)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    before = run_steps(runner, prompts, chunk=8, decodes=2)[-1]
    down = runner.model.layers[1].down_proj.packed_weight
    assert down.is_floating_point()
    with torch.no_grad():
        down.mul_(2)
    try:
        after = run_steps(runner, prompts, chunk=8, decodes=2)[-1]
    finally:
        with torch.no_grad():
            down.div_(2)
    assert stack.calls == 2
    assert not torch.equal(before, after)
    assert torch.equal(run_steps(runner, prompts, chunk=8, decodes=2)[-1], before)


@needs_f32_stack
def test_switched_off_and_where_it_does_not_apply(llama_hd64_dir, tiny_llama_dir):
    tiny = runner_for(tiny_llama_dir, "float32")  # head_dim 16: no native rotary
    assert tiny.model.decode_step is None and tiny.forward_path == "model"
    qwen3_like = runner_for(llama_hd64_dir, "float32")
    qwen3_like.model.layers[0].q_norm = qwen3_like.model.layers[0].input_norm  # q/k norms
    from worker_svc import decode_stack

    assert decode_stack.build(qwen3_like.model) is None
    runner = runner_for(llama_hd64_dir, "float32")
    assert runner.forward_path == "model+decode-stack"
    off = counted(runner.model.decode_step)
    off.enabled = False  # the Python loop, to compare
    assert runner.forward_path == "model"
    prompts = [[5, 6, 7], [8, 9]]
    want = run_steps(runner, prompts, chunk=4, decodes=4)
    assert off.calls == 0
    on = runner_for(llama_hd64_dir, "float32")
    stack = counted(on.model.decode_step)
    got = run_steps(on, prompts, chunk=4, decodes=4)
    assert stack.calls == 3 and len(got) == len(want) == 4
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    with torch.profiler.profile() as prof:  # the loop, so that each op shows in the profile
        profiled = run_steps(on, prompts, chunk=4, decodes=4)
    assert stack.calls == 3
    assert any(e.key == packed_gemm.PROFILE_NAME for e in prof.key_averages())
    assert all(torch.equal(g, w) for g, w in zip(profiled, want, strict=True))


def test_not_built_for_the_reference_backend(llama_hd64_dir):
    runner = ModelRunner(
        ModelRunnerConfig(
            model=str(llama_hd64_dir), kernels="reference", block_size=4, num_gpu_blocks=64
        )
    )
    assert runner.model.decode_step is None and runner.forward_path == "model"
    from worker_svc import decode_stack

    assert decode_stack.build(runner.model) is None  # torch linears: not the stack's kernels


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_smollm2_decode_batch(dtype):
    """The real model, 45 decode rows at contexts of 20-300 tokens (16-token blocks)."""
    runner = ModelRunner(
        ModelRunnerConfig(model=None, dtype=dtype, num_gpu_blocks=1024, num_threads=2)
    )
    counted(runner.model.decode_step)
    prompts = [
        [(i * 131 + j * 17) % 40000 + 100 for j in range(20 + (i * 53) % 280)] for i in range(45)
    ]
    got, want, used = stack_vs_loop(runner, prompts, chunk=40, decodes=4)
    assert 3 <= used < len(got)  # the pure-decode steps at the end, not the mixed ones
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
