"""A bfloat16 worker behind the real scheduler: concurrent greedy requests over gRPC give the
tokens of the same runner in one process, though the two batch them differently. On this CPU
every bfloat16 kernel computes a row alone (AMX GEMMs up to 512 rows, per-row attention, norms
and rotary), so a row's logits do not depend on its batch; the worker's decode steps run on
the native decode stack, its mixed steps on the layer loop."""

from __future__ import annotations

import threading

import pytest

from common.client import SplitserveClient
from common.tokenizer import load_tokenizer
from tests.e2e.procs import Cluster
from tests.e2e.test_grpc_system import assert_no_block_leak

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three prime numbers:",
    "import numpy as np\n",
    "The quick brown fox",
]
MAX_TOKENS = 24
BUDGET = "512"  # every prompt is prefilled in one chunk, in both


def _needs_amx_stack():
    from worker_svc import amx_gemm, native_attention

    kernel = native_attention.load()
    if amx_gemm.load() is None or kernel is None or not kernel.bf16_dot:
        pytest.skip("needs AMX and the AVX512-BF16 decode attention")


@pytest.fixture(scope="module")
def in_process():
    _needs_amx_stack()
    from splitserve.inprocess import generate_in_process
    from worker_svc.config import ModelRunnerConfig
    from worker_svc.model_runner import ModelRunner

    runner = ModelRunner(
        ModelRunnerConfig(model=None, dtype="bfloat16", num_gpu_blocks=192, num_threads=2)
    )
    assert runner.forward_path == "model+decode-stack"
    ids = [load_tokenizer(None).encode(p) for p in PROMPTS]
    outs = generate_in_process(
        ids, max_tokens=MAX_TOKENS, runner=runner, max_num_batched_tokens=int(BUDGET)
    )
    return dict(zip(PROMPTS, outs, strict=True))


@pytest.fixture(scope="module")
def bf16_client(tmp_path_factory, in_process):
    c = Cluster(tmp_path_factory.mktemp("bf16-cluster"))
    c.start_scheduler(
        "--max-num-batched-tokens", BUDGET, "--max-num-seqs", "32", "--max-model-len", "1024"
    )
    c.start_worker(
        "w0",
        "--dtype",
        "bfloat16",
        "--num-threads",
        "2",
        "--num-gpu-blocks",
        "192",
        "--block-size",
        "16",
    )
    try:
        with SplitserveClient(c.target, timeout=120) as client:
            client.wait_for_workers(1, timeout=240)
            yield client, c
    except BaseException:
        print(c.logs())
        raise
    finally:
        c.stop_all()


def test_concurrent_requests_give_the_in_process_tokens(bf16_client, in_process):
    bf16_client, cluster = bf16_client
    results: dict[str, object] = {}

    def one(prompt: str) -> None:
        results[prompt] = bf16_client.generate(
            prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
        )

    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert set(results) == set(PROMPTS)
    for prompt in PROMPTS:
        result = results[prompt]
        assert result.finish_reason == "length"
        assert result.token_ids == in_process[prompt], prompt
    assert_no_block_leak(bf16_client)
    worker_log = next(p for p in cluster.procs if p.name == "w0").log()
    assert '"forward": "model+decode-stack"' in worker_log
