"""`--kernels reference|native` (ModelRunnerConfig.kernels): reference runs torch's own ops only
(the ReferenceOps table, F.linear over the loaded weights), without the native library, and
gives Hugging Face's greedy tokens; native is the default and runs other kernels."""

from __future__ import annotations

import argparse

import pytest

torch = pytest.importorskip("torch")

from common.messages import CachedRequestData  # noqa: E402
from common.settings import add_dataclass_args, dataclass_from_args  # noqa: E402
from tests.unit.worker.test_worker_model_runner import new, step  # noqa: E402
from worker_svc import native_attention, quantization  # noqa: E402
from worker_svc.config import ModelRunnerConfig  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402
from worker_svc.ops import NativeOps, ReferenceOps  # noqa: E402
from worker_svc.ops.reference import ReferenceLinear  # noqa: E402

PROMPTS = {"a": [7, 99, 23, 300, 41, 5, 77], "b": [3, 4], "c": list(range(40, 61))}
NEW_TOKENS = 8


def parse(argv):
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, ModelRunnerConfig)
    return dataclass_from_args(ModelRunnerConfig, parser.parse_args(argv))


def test_flag_environment_and_choices(monkeypatch):
    assert parse([]).kernels == "native"
    assert parse(["--kernels", "reference"]).kernels == "reference"
    monkeypatch.setenv("SPLITSERVE_KERNELS", "reference")
    assert parse([]).kernels == "reference"
    with pytest.raises(ValueError, match="unknown kernels"):
        ModelRunnerConfig(kernels="fast")


def test_reference_refuses_int8_with_a_sentence():
    with pytest.raises(quantization.Unsupported, match="--kernels reference") as caught:
        quantization.check_supported("int8", torch.device("cpu"), torch.float32, "reference")
    assert str(caught.value).endswith("--quantization none.")


def greedy(runner):
    """Every prompt prefilled in one step, then NEW_TOKENS - 1 decode steps of all of them."""
    blocks = {rid: list(range(i * 8, i * 8 + 8)) for i, rid in enumerate(PROMPTS)}
    reqs = [new(rid, prompt, blocks[rid]) for rid, prompt in PROMPTS.items()]
    out = step(runner, reqs, scheduled={rid: len(p) for rid, p in PROMPTS.items()})
    got = {rid: [] for rid in PROMPTS}
    for _ in range(NEW_TOKENS - 1):
        for rid in PROMPTS:
            got[rid] += out.sampled_token_ids[rid]
        cached = [
            CachedRequestData(rid, [], len(PROMPTS[rid]) + len(got[rid]) - 1) for rid in PROMPTS
        ]
        out = step(runner, cached=cached, scheduled=dict.fromkeys(PROMPTS, 1))
    for rid in PROMPTS:
        got[rid] += out.sampled_token_ids[rid]
    return got


def test_reference_runs_without_the_native_library_and_gives_hf_greedy_tokens(
    tiny_llama_dir, monkeypatch
):
    from transformers import AutoModelForCausalLM

    def no_library():
        raise AssertionError("--kernels reference called the native library")

    monkeypatch.setattr(native_attention, "load", no_library)
    config = ModelRunnerConfig(
        model=str(tiny_llama_dir), kernels="reference", block_size=4, num_gpu_blocks=32
    )
    runner = ModelRunner(config)
    assert runner.kernels == "reference cpu"
    assert type(runner.ops) is ReferenceOps and runner.linear_kind == "torch"
    assert runner.model.decode_step is None and runner.forward_path == "model"
    assert runner.decode_kernel is None and not runner.native_prefill
    assert runner.sampler.fast_argmax is None
    for layer in runner.model.layers:  # torch's F.linear over the weights as loaded
        linears = [layer.qkv.linear, layer.gated.gate_up, layer.o_proj, layer.down_proj]
        assert all(type(x) is ReferenceLinear for x in linears)
    assert type(runner.model.lm_head) is ReferenceLinear
    got = greedy(runner)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for rid, prompt in PROMPTS.items():
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[
                0, len(prompt) :
            ].tolist()
        assert got[rid] == want, rid


def test_native_and_reference_give_the_same_greedy_tokens(tiny_llama_dir):
    runners = {
        kernels: ModelRunner(
            ModelRunnerConfig(
                model=str(tiny_llama_dir), kernels=kernels, block_size=4, num_gpu_blocks=32
            )
        )
        for kernels in ("native", "reference")
    }
    native = runners["native"]
    assert native.kernels.split()[0] != "reference" and isinstance(native.ops, NativeOps)
    if native.ops.linear_kind != "torch":
        linear = native.model.layers[0].o_proj
        assert not isinstance(linear, ReferenceLinear), native.kernels
    assert greedy(runners["native"]) == greedy(runners["reference"])
