"""Aging bounds the longest wait: a long prompt in a stream of short ones that never lets up
(more than the worker can take) starves under sjf until the stream ends; sjf-aging serves it
within (its excess tokens) / aging_rate seconds plus the work that arrived before that."""

from __future__ import annotations

import pytest

from splitserve.sim import SimSettings, StepCostModel, TraceRequest, simulate

COST = StepCostModel(base_s=0.05, per_token_s=1e-4, per_ctx_token_s=0.0, per_seq_s=0.0)
STREAM_S = 10.0


def trace() -> list[TraceRequest]:
    rate = 25.0  # short requests per second; the worker takes ~16
    shorts = [TraceRequest(f"s{i}", i / rate, 32, 4) for i in range(int(STREAM_S * rate))]
    return [*shorts, TraceRequest("long", 0.5, 120, 4)]


def long_ttft(policy: str, **options) -> float:
    settings = SimSettings(
        policy=policy, policy_options=options, max_num_batched_tokens=128, max_num_seqs=4
    )
    res = simulate(settings, trace(), COST)
    assert all(r.finish is not None for r in res.records)
    (long,) = [r for r in res.records if r.request_id == "long"]
    return long.ttft


def test_sjf_starves_the_long_prompt_until_the_stream_ends():
    assert long_ttft("sjf") > STREAM_S


@pytest.mark.parametrize("rate", [50.0, 100.0, 400.0])
def test_sjf_aging_bounds_its_wait(rate):
    # shorts arriving later than (120 - 32) / rate s after it no longer pass it
    bound = (120 - 32) / rate + 1.0
    assert long_ttft("sjf-aging", aging_rate=rate) < bound


def test_priority_aging_lets_a_low_priority_request_through():
    shorts = [TraceRequest(f"s{i}", i / 25.0, 32, 4, priority=0) for i in range(250)]
    low = TraceRequest("low", 0.5, 32, 4, priority=3)
    settings = dict(max_num_batched_tokens=128, max_num_seqs=4)
    plain = simulate(SimSettings(policy="priority", **settings), [*shorts, low], COST)
    aged = simulate(
        SimSettings(policy="priority-aging", policy_options={"aging_rate": 1.0}, **settings),
        [*shorts, low],
        COST,
    )
    ttft = {
        res.settings.policy: next(r.ttft for r in res.records if r.request_id == "low")
        for res in (plain, aged)
    }
    assert ttft["priority"] > STREAM_S
    assert ttft["priority-aging"] < 3 / 1.0 + 1.5
