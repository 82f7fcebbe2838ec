"""The native decode stack (worker_svc/decode_stack.py) runs a pure-decode step's layers in one
call and gives the Python layer loop's logits bit for bit (and so HF's forward's), in float32
and bfloat16; steps with prefill chunks, steps under the profiler, and a stack switched off
(DecodeStack.enabled) keep the loop."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.cpu_levels import needs_level  # noqa: E402
from tests.unit.worker.test_decoder_loop import run_steps  # noqa: E402
from worker_svc import native_attention  # noqa: E402
from worker_svc.config import ModelRunnerConfig  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402


def _bf16_decode_body() -> bool:
    kernel = native_attention.load()
    return kernel is not None and kernel.bf16_dot


needs_stack = needs_level("amx", "the bfloat16 decode stack")
needs_f32_stack = needs_level("avx512", "the float32 decode stack")
DTYPES = [
    pytest.param("float32", marks=needs_f32_stack),
    pytest.param("bfloat16", marks=needs_stack),
]


@pytest.fixture(scope="module")
def llama_hd64_dir(tmp_path_factory):
    """A 2-layer random Llama with head_dim 64 (hidden 128, 2 heads / 1 KV head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=512,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    path = tmp_path_factory.mktemp("llama-hd64")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def counted(stack):
    """`stack`, its calls counted in stack.calls from here on."""
    stack.calls = 0
    original = type(stack).__call__

    def call(self, *args):
        self.calls += 1
        return original(self, *args)

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
    """Each step's logits with the stack on, then with it off (the Python loop)."""
    stack = runner.decoder_loop.stack
    stack.enabled = True
    got = run_steps(runner, prompts, chunk, decodes)
    used = stack.calls
    stack.enabled = False
    try:
        want = run_steps(runner, prompts, chunk, decodes)
    finally:
        stack.enabled = True
    return got, want, used


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_steps_are_the_layer_loops_bits(llama_hd64_dir, dtype):
    runner = runner_for(llama_hd64_dir, dtype)
    counted(runner.decoder_loop.stack)
    # 37 rows: not a multiple of the GEMM's 32-row tiles; contexts over several 4-token blocks
    prompts = [[(i * 7 + j * 3) % 500 + 3 for j in range(2 + i % 11)] for i in range(37)]
    got, want, used = stack_vs_loop(runner, prompts, chunk=16, decodes=5)
    assert used == len(got) - 1 == 4  # every step but the prefill
    assert len(got) == len(want) and all(g.dtype == getattr(torch, dtype) for g in got)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    # and the same as Hugging Face's forward on the same modules
    loop, runner.decoder_loop = runner.decoder_loop, None
    try:
        hf = run_steps(runner, prompts, chunk=16, decodes=5)
    finally:
        runner.decoder_loop = loop
    assert all(torch.equal(g, h) for g, h in zip(got, hf, strict=True))


@needs_stack
def test_reads_the_live_weights(llama_hd64_dir):
    """The stack reads the live weights: a change to one shows in its logits, undoing it
    restores them."""
    runner = runner_for(llama_hd64_dir)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    before = run_steps(runner, prompts, chunk=8, decodes=2)[-1]
    mlp = runner.decoder_loop.layers[1].mlp
    with torch.no_grad():
        mlp.down_proj.packed_weight.mul_(2)
    try:
        after = run_steps(runner, prompts, chunk=8, decodes=2)[-1]
    finally:
        with torch.no_grad():
            mlp.down_proj.packed_weight.div_(2)
    assert not torch.equal(before, after)
    assert torch.equal(run_steps(runner, prompts, chunk=8, decodes=2)[-1], before)


@needs_stack
def test_switched_off_and_where_it_does_not_apply(llama_hd64_dir, tiny_llama_dir):
    assert runner_for(tiny_llama_dir).forward_path == "decoder-loop"  # head_dim 16: no rotary
    runner = runner_for(llama_hd64_dir)
    assert runner.forward_path == "decoder-loop+decode-stack"
    off = counted(runner.decoder_loop.stack)
    off.enabled = False  # the Python loop, to compare
    assert runner.forward_path == "decoder-loop"
    prompts = [[5, 6, 7], [8, 9]]
    want = run_steps(runner, prompts, chunk=4, decodes=4)
    assert off.calls == 0
    on = runner_for(llama_hd64_dir)
    stack = counted(on.decoder_loop.stack)
    got = run_steps(on, prompts, chunk=4, decodes=4)
    assert stack.calls == 3 and len(got) == len(want) == 4
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    with torch.profiler.profile() as prof:  # the loop, so that each op shows in the profile
        profiled = run_steps(on, prompts, chunk=4, decodes=4)
    assert stack.calls == 3
    assert any(e.key == "splitserve::amx_gemm" for e in prof.key_averages())
    assert all(torch.equal(g, w) for g, w in zip(profiled, want, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_smollm2_decode_batch(dtype):
    """The real model, 45 decode rows at contexts of 20-300 tokens (16-token blocks)."""
    runner = ModelRunner(
        ModelRunnerConfig(model=None, dtype=dtype, num_gpu_blocks=1024, num_threads=2)
    )
    counted(runner.decoder_loop.stack)
    prompts = [
        [(i * 131 + j * 17) % 40000 + 100 for j in range(20 + (i * 53) % 280)] for i in range(45)
    ]
    got, want, used = stack_vs_loop(runner, prompts, chunk=40, decodes=4)
    assert 3 <= used < len(got)  # the pure-decode steps at the end, not the mixed ones
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
