"""Swap and auto preemption on the REAL runner (a tiny random Llama, in process): greedy outputs
equal recompute's and those of a pool too big to preempt; the worker's cost probe."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from scheduler_svc.core import SamplingParams, SchedulerConfig  # noqa: E402
from scheduler_svc.core.preemption_cost import WorkerCosts  # noqa: E402
from splitserve.inprocess import InProcessEngine  # noqa: E402


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    from worker_svc.config import ModelRunnerConfig
    from worker_svc.model_runner import ModelRunner

    return ModelRunner(
        ModelRunnerConfig(
            model=str(tiny_llama_dir),
            block_size=4,
            num_gpu_blocks=256,
            num_host_blocks=64,
            max_num_seqs=16,
            max_num_batched_tokens=256,
            num_threads=1,
        )
    )


PROMPTS = [[random.Random(i).randrange(3, 512) for _ in range(8 + 3 * i)] for i in range(6)]


def generate(runner, mode: str, num_blocks: int, num_host_blocks: int = 0, costs=None):
    cfg = SchedulerConfig(
        max_num_batched_tokens=32,
        max_num_seqs=6,
        block_size=4,
        num_blocks=num_blocks,
        num_host_blocks=num_host_blocks,
        max_model_len=256,
        preemption_mode=mode,
        worker_costs=costs,
        auto_swap_min_tokens=30,
    )
    engine = InProcessEngine(runner, cfg)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add(f"p{i}", p, params)
    outputs = engine.run()
    return [outputs[f"p{i}"] for i in range(len(PROMPTS))], engine.scheduler.stats()


def test_swap_and_auto_outputs_equal_recompute_and_no_preemption(runner):
    reference, st = generate(runner, "recompute", num_blocks=256)
    assert st.num_preemptions == 0 and all(len(o) == 20 for o in reference)
    # 24 blocks of 4 = 96 tokens for 6 requests of 28..43 tokens each: preemptions
    recompute, st = generate(runner, "recompute", num_blocks=24)
    assert st.num_preemptions > 0 and st.num_recomputed_tokens > 0
    assert recompute == reference
    swap, st = generate(runner, "swap", num_blocks=24, num_host_blocks=64)
    assert st.num_swap_outs > 0 and st.num_swap_ins == st.num_swap_outs
    assert st.num_recomputed_tokens == 0
    assert swap == reference
    # auto: with a copy latency of 2 ms these short victims are cheaper to recompute, with
    # 1 ms cheaper to swap (recompute 1e-4 T + 1e-6 T^2 against 2 (latency + T/4 * 1 KiB / 1e8))
    for latency, swaps in ((2e-3, False), (1e-3, True)):
        costs = WorkerCosts(
            prefill_s_per_token=1e-4,
            prefill_s_per_token_ctx=2e-6,
            swap_bytes_per_s=1e8,
            swap_latency_s=latency,
            kv_bytes_per_block=1024,
        )
        auto, st = generate(runner, "auto", num_blocks=24, num_host_blocks=64, costs=costs)
        assert st.num_preemptions > 0 and (st.num_swap_outs > 0) is swaps
        assert (st.num_recomputed_tokens > 0) is not swaps
        assert auto == reference
    host_full, st = generate(runner, "swap", num_blocks=24, num_host_blocks=3)
    assert st.num_recomputed_tokens > 0  # fell back to recompute
    assert host_full == reference


def test_cost_probe_measures_and_leaves_the_runner_clean(runner):
    from worker_svc.cost_probe import measure_costs
    from worker_svc.link import WorkerLinkClient, WorkerLinkConfig

    costs = measure_costs(runner)
    assert costs["prefill_s_per_token"] > 0 and costs["swap_bytes_per_s"] > 0
    # verification steps of 1, 2, 4, ... 64 tokens (the runner's step budget allows them all)
    assert len(costs["verify_step_s"]) == 7 and min(costs["verify_step_s"]) > 0
    assert (
        costs["kv_bytes_per_block"] == 2 * 2 * 4 * 2 * 16 * 4
    )  # layers, K/V, bs, heads, dim, fp32
    parsed = WorkerCosts(**costs)
    assert parsed.known
    client = WorkerLinkClient(WorkerLinkConfig(), runner)
    reg = client.registration()
    assert reg.prefill_s_per_token > 0 and reg.kv_bytes_per_block == costs["kv_bytes_per_block"]
    assert len(WorkerCosts.from_message(reg).verify_step_s) == 7
    assert client.registration().prefill_s_per_token == reg.prefill_s_per_token  # measured once
    off = WorkerLinkClient(WorkerLinkConfig(measure_costs=False), runner)
    assert off.registration().prefill_s_per_token == 0
    # the runner still generates exactly as before
    again, _ = generate(runner, "recompute", num_blocks=256)
    reference, _ = generate(runner, "swap", num_blocks=24, num_host_blocks=64)
    assert again == reference
