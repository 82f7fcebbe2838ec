"""The preemption cost model: auto picks swap for a long context and recompute for a short one
(given the worker's costs), falls back to recompute when the host is full; waste per freed block
for victim choice; the worker's measured costs travel in Register."""

from __future__ import annotations

import pytest

from common.pb import worker_link_pb2 as pb
from scheduler_svc.core import Request, RequestStatus, SamplingParams, Scheduler
from scheduler_svc.core.preemption_cost import PreemptionCostModel, WorkerCosts
from tests.factories import request, scheduler_factory

# bs 16, 256 KiB per block, 1 GB/s, 2 ms per copy; prefill 0.1 ms/token + attention 5e-8 s
# per token per context token: recompute(T) = 1e-4 T + 5e-8 T^2 / 2 (short contexts cheap),
# swap(T) = 2 (2e-3 + T/16 * 262144 / 1e9) (a fixed latency, then linear): crossover ~ 60 tokens
COSTS = WorkerCosts(
    prefill_s_per_token=1e-4,
    prefill_s_per_token_ctx=5e-8,
    swap_bytes_per_s=1e9,
    swap_latency_s=2e-3,
    kv_bytes_per_block=262144,
)


make = scheduler_factory(
    max_num_batched_tokens=2048,
    max_num_seqs=8,
    block_size=16,
    num_blocks=64,
    max_model_len=2048,
    policy="priority",
    preemption_mode="auto",
    num_host_blocks=64,
    worker_costs=COSTS,
    watermark=0.0,
)


def req(rid, n, priority=0, arrival=0.0, base=0) -> Request:
    tokens = [base + i % 900 + 3 for i in range(n)]
    return request(rid, tokens, max_tokens=500, ignore_eos=True, priority=priority, arrival=arrival)


def step(s: Scheduler):
    out = s.schedule()
    sampled = {}
    for rid in out.num_scheduled_tokens:
        r = s.get_request(rid)
        sampled[rid] = [7] if r is not None and r.num_computed_tokens >= r.num_tokens else []
    s.update_from_output(out, sampled)
    return out


def test_cost_formulas_and_the_crossover():
    s = make(num_blocks=128)
    model = s._cost
    for rid, n in (("short", 16), ("long", 1024)):
        s.add_request(req(rid, n, base=len(rid)))
    step(s)
    short, long = s.get_request("short"), s.get_request("long")
    assert model.recompute_s(short) == pytest.approx(16e-4 + 5e-8 * 16 * 16 / 2)
    assert model.swap_s(short) == pytest.approx(2 * (2e-3 + 262144 / 1e9))
    assert model.recompute_s(long) == pytest.approx(1024e-4 + 5e-8 * 1024 * 1024 / 2)
    assert model.swap_s(long) == pytest.approx(2 * (2e-3 + 64 * 262144 / 1e9))
    assert not model.prefers_swap(short) and model.prefers_swap(long)
    # waste is per block freed: the short one frees 1 block, the long one 64
    assert model.waste(short) == pytest.approx(model.recompute_s(short) / 1)
    assert model.waste(long) == pytest.approx(model.swap_s(long) / 64)


@pytest.mark.parametrize("prompt, swapped", [(16, False), (700, True)])
def test_auto_swaps_a_long_victim_and_recomputes_a_short_one(prompt, swapped):
    # the victim (priority 1) has `prompt` tokens; the other fills the pool and keeps growing
    s = make(num_blocks=-(-prompt // 16) + 10)
    s.add_request(req("victim", prompt, priority=1, base=1))
    s.add_request(req("grower", 150, priority=0, arrival=1.0, base=2))
    out = None
    for _ in range(200):
        out = step(s)
        if out.preempted_req_ids:
            break
    assert out.preempted_req_ids == {"victim"}
    victim = next(r for r in [*s.swapped, *s.waiting] if r.request_id == "victim")
    assert bool(out.blocks_to_swap_out) is swapped
    if swapped:
        assert victim.status is RequestStatus.SWAPPED and victim.num_computed_tokens >= prompt
    else:
        assert victim.status is RequestStatus.PREEMPTED and victim.num_computed_tokens == 0


def test_auto_falls_back_to_recompute_when_the_host_pool_is_full():
    s = make(num_blocks=54, num_host_blocks=8)  # the long victim needs 44 host blocks
    s.add_request(req("victim", 700, priority=1, base=1))
    s.add_request(req("grower", 150, priority=0, arrival=1.0, base=2))
    out = None
    for _ in range(200):
        out = step(s)
        if out.preempted_req_ids:
            break
    assert out.preempted_req_ids == {"victim"} and not out.blocks_to_swap_out
    assert s.waiting.get("victim").status is RequestStatus.PREEMPTED


def test_without_measured_costs_auto_uses_the_token_threshold():
    kv_owner = make(worker_costs=None, auto_swap_min_tokens=100)
    model = kv_owner._cost
    kv_owner.add_request(req("a", 50))
    kv_owner.add_request(req("b", 200, base=5))
    step(kv_owner)
    a, b = kv_owner.get_request("a"), kv_owner.get_request("b")
    assert not model.prefers_swap(a) and model.prefers_swap(b)
    assert model.waste(a) == pytest.approx(50 / 4)  # tokens lost per block freed
    recompute = PreemptionCostModel(kv_owner.kv, "recompute", COSTS)
    assert not recompute.prefers_swap(b)
    assert PreemptionCostModel(kv_owner.kv, "swap").prefers_swap(a)


def test_shared_prefix_blocks_are_neither_lost_nor_freed():
    s = make()
    shared = [i % 900 + 3 for i in range(64)]
    s.add_request(Request("x", shared + [1, 2, 3], SamplingParams(max_tokens=50)))
    step(s)
    s.add_request(Request("y", shared + [4, 5, 6], SamplingParams(max_tokens=50), arrival_time=1))
    step(s)
    y = s.get_request("y")
    h, c = s._cost.recompute_span(y)
    assert (h, c) == (64, 67)  # 4 shared blocks stay cached: only 3 tokens are lost
    assert s._cost.waste(y) == pytest.approx(s._cost.recompute_s(y) / 1)  # frees 1 block


def test_costs_from_the_register_message():
    assert WorkerCosts.from_message(pb.Register(worker_id="w")) is None
    reg = pb.Register(
        prefill_s_per_token=1e-4,
        prefill_s_per_token_ctx=5e-8,
        swap_bytes_per_s=1e9,
        swap_latency_s=2e-3,
        kv_bytes_per_block=262144,
    )
    assert WorkerCosts.from_message(reg) == COSTS and COSTS.known
    assert not WorkerCosts(prefill_s_per_token=1e-4).known
