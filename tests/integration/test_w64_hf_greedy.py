"""The real SmolLM2 on the W64 prompts: the runner's greedy tokens equal Hugging Face
`generate(do_sample=False)` in float32, on each backend this machine has (reference: torch's
ops; native: this CPU level's kernels, the decode stack included), all prompts in one batch with
chunked prefill beside the decodes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.integration.test_runner_hf_equality import Driver, hf_greedy  # noqa: E402
from worker_svc.config import ModelRunnerConfig  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402

pytestmark = pytest.mark.slow

W64 = Path(__file__).resolve().parents[2] / "bench/workloads/w64.json"
NUM_PROMPTS, NUM_TOKENS = 16, 16


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    from common.model_source import resolve_model
    from worker_svc.model_loader import model_dir

    prompts = json.loads(W64.read_text())["prompts"][:NUM_PROMPTS]
    hf = AutoModelForCausalLM.from_pretrained(
        model_dir(resolve_model(None)), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        refs = {f"p{i}": hf_greedy(hf, p, NUM_TOKENS) for i, p in enumerate(prompts)}
    return prompts, refs


@pytest.mark.parametrize("kernels", ["reference", "native"])
def test_w64_greedy_equals_hugging_face(kernels, reference):
    prompts, refs = reference
    runner = ModelRunner(
        ModelRunnerConfig(
            model=None, kernels=kernels, num_gpu_blocks=320, warmup_tokens=0, num_threads=2
        )
    )
    d = Driver(runner, chunk=256)
    for i, p in enumerate(prompts):
        d.add(f"p{i}", p, NUM_TOKENS)
    outputs = d.run()
    for req_id, ref in refs.items():
        assert outputs[req_id][: len(ref)] == ref, (kernels, req_id)  # HF stops at EOS
