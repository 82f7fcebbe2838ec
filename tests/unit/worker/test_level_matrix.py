"""Every x86 level this CPU has, forced in turn: the native library built for that level (as on
an older CPU: SPLITSERVE_CPU_LEVEL caps the probe and the compiler target), loaded in a fresh
process, runs the model on the native backend with the reference backend's greedy tokens
(float32), with bfloat16 weights gives the float32 logits of the first step (the three
prompts' prefill) to within bfloat16's rounding, and with int8 weights what the reference gives
over the same weights quantized and dequantized. A level the CPU lacks is skipped,
named. The whole worker suite also runs capped at avx2 in CI (Makefile `test`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from worker_svc import cpu_caps  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
LEVELS = [level for level in cpu_caps.LEVELS if level != "none"]
CAPS = cpu_caps.capabilities()

CHILD = r"""
import json, random, sys
import torch
from tests.integration.test_runner_hf_equality import Driver
from worker_svc.config import ModelRunnerConfig
from worker_svc.model_runner import ModelRunner

model_dir, dequantized_dir = sys.argv[1], sys.argv[2]
rng = random.Random(7)
prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 23, 40)]

class FirstLogits:
    def __init__(self, model):
        self.model, self.logits = model, None

    def __call__(self, *args):
        out = self.model(*args)
        if self.logits is None:
            self.logits = out.float().tolist()
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)

def generate(model=model_dir, **options):
    runner = ModelRunner(ModelRunnerConfig(model=model, block_size=16, num_gpu_blocks=24,
                                           warmup_tokens=0, num_threads=2, **options))
    runner.model = recorder = FirstLogits(runner.model)
    d = Driver(runner)
    for i, p in enumerate(prompts):
        d.add(f"p{i}", p, 10)
    return runner.kernels, d.run(), recorder.logits

out = {}
for name, options in {
    "reference": {"kernels": "reference"},
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "reference_int8_weights": {"kernels": "reference", "model": dequantized_dir},
}.items():
    kernels, tokens, logits = generate(**options)
    out[name] = {"kernels": kernels, "tokens": tokens, "logits": logits}
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def head_dim_64_llama(tmp_path_factory):
    """A 2-layer random Llama whose head_dim (64) takes every native kernel (rotary, the decode
    stack, native prefill)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2)
    path = tmp_path_factory.mktemp("llama-hd64")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def int8_weights_llama(head_dim_64_llama, tmp_path_factory):
    """The same model with each linear's weight rounded to what --quantization int8 keeps."""
    from transformers import AutoModelForCausalLM

    from worker_svc.quantization import quantize_int8

    model = AutoModelForCausalLM.from_pretrained(head_dim_64_llama, dtype=torch.float32)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                q, scale = quantize_int8(module.weight)
                module.weight.copy_(q.float() * scale[:, None])
    path = tmp_path_factory.mktemp("llama-hd64-int8")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("level", LEVELS)
def test_each_level_runs_the_model_as_the_reference_does(
    level, head_dim_64_llama, int8_weights_llama
):
    rank = cpu_caps.LEVELS.index
    if rank(level) > rank(CAPS.cpu_level):  # the real CPU's flags
        pytest.skip(f"the {level} level: this CPU ({CAPS.cpu_level}) lacks it")
    if rank(level) > rank(CAPS.level):  # a cap on this run
        pytest.skip(f"the {level} level: this run is capped at {CAPS.level}")
    env = {**os.environ, cpu_caps.ENV_VAR: level, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(head_dim_64_llama), str(int8_weights_llama)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    runs = json.loads(line[len("RESULT") :])
    assert runs["reference"]["kernels"] == "reference cpu"
    native = runs["float32"]["kernels"].split()
    assert native[0] == level  # the library and kernels of the forced level
    words = dict(w.split("=") for w in native[1:])
    assert words["linear"] == "native-packed" and words["decode-attention"] == "native"
    assert words["forward"] == "model+decode-stack"
    ref = runs["reference"]["tokens"]
    assert runs["float32"]["tokens"] == ref
    for name, oracle, tolerance in (
        ("bfloat16", "reference", 0.05),
        ("int8", "reference_int8_weights", 1e-4),
    ):
        want = torch.tensor(runs[oracle]["logits"])
        error = (torch.tensor(runs[name]["logits"]) - want).abs().max() / want.abs().max()
        assert error < tolerance, (name, float(error))
        assert sorted(runs[name]["tokens"]) == sorted(ref)  # every request ran to its end
    assert runs["int8"]["tokens"] == runs["reference_int8_weights"]["tokens"]
