"""The padded decode step that CUDA graphs replay (worker_svc/cuda_graphs.py), run eagerly on the
CPU: padding rows, scratch block, block-table widths and masks must leave the greedy tokens
equal to Hugging Face's; on a GPU the same steps are captured and replayed (bench/gpu_check.py).
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from tests.integration.test_runner_hf_equality import Driver, hf_greedy  # noqa: E402
from worker_svc.config import ModelRunnerConfig  # noqa: E402
from worker_svc.cuda_graphs import DecodeGraphs, batch_buckets, width_buckets  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402


def test_buckets_cover_every_size_once():
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(1000)[-1] == 256
    assert width_buckets(10) == [10]
    assert width_buckets(512) == [16, 64, 256, 512]


@pytest.fixture(scope="module")
def graphed(tiny_llama_dir):
    runner = ModelRunner(
        ModelRunnerConfig(
            model=str(tiny_llama_dir),
            block_size=4,
            num_gpu_blocks=96,
            kernels="reference",
            max_num_seqs=6,
        )
    )
    runner.decode_graphs = DecodeGraphs(
        runner.model,
        runner.kv_cache,
        max_rows=6,
        max_blocks_per_seq=runner.batch.block_table.shape[1],
        capture=False,
    )
    return runner


def test_padded_decode_steps_keep_hf_greedy(graphed, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(k)] for k in (3, 10, 21, 37, 70)]
    with torch.no_grad():
        refs = {f"p{i}": hf_greedy(hf, p, 12) for i, p in enumerate(prompts)}
    d = Driver(graphed, chunk=8)
    for i, p in enumerate(prompts[:3]):
        d.add(f"p{i}", p, 12)
    for _ in range(4):
        d.step()
    d.preempt("p1")  # its blocks go back; the scratch block must never be handed out
    for i, p in enumerate(prompts[3:], start=3):
        d.add(f"p{i}", p, 12)
    for _ in range(3):
        d.step()
    d.resume("p1")
    outputs = d.run()
    for req_id, ref in refs.items():
        assert outputs[req_id][: len(ref)] == ref, req_id
    graphs = graphed.decode_graphs
    used = set(graphs._static)  # noqa: SLF001
    # pure-decode steps of 1 to 4 rows, padded to the buckets 1, 2, 4; two block-table widths
    assert {rows for rows, _ in used} == {1, 2, 4} and len({w for _, w in used}) >= 2
    assert graphed.kv_cache.scratch_block == graphed.num_blocks


def test_scratch_block_is_outside_the_blocks_the_scheduler_sees(graphed):
    cache = graphed.kv_cache
    assert cache.key_caches[0].shape[0] == graphed.num_blocks + 1
    with pytest.raises(ValueError, match="out of range"):
        cache.swap_out([(graphed.num_blocks, 0)])
