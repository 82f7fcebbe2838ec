"""The metrics observer on its own: exact counts, a migrated request's TTFT counted once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from scheduler_svc.core import FinishReason
from scheduler_svc.obs.engine_observer import EngineObserver, ObserverGroup
from scheduler_svc.obs.metrics import MetricsObserver


def values(obs: MetricsObserver) -> dict:
    out = {}
    for family in text_string_to_metric_families(generate_latest(obs.registry).decode()):
        for s in family.samples:
            out[s.name + "".join(f"|{v}" for v in s.labels.values())] = s.value
    return out


def state(rid="r", prompt=5, arrival=100.0):
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=[1] * prompt,
        output_token_ids=[],
        arrival_time=arrival,
        first_token_time=None,
        last_token_time=None,
        finish_time=None,
        finish_reason=None,
    )


def deliver(obs, st, n, now):
    st.output_token_ids.extend([7] * n)
    st.first_token_time = st.first_token_time or now
    st.last_token_time = now
    obs.on_tokens(st, n, now)


def test_request_lifecycle_counts():
    obs = MetricsObserver()
    st = state()
    obs.on_request_accepted(st)
    obs.on_step(
        SimpleNamespace(worker_id="w0"),
        SimpleNamespace(
            new_requests=[SimpleNamespace(request_id="r")], total_num_scheduled_tokens=5
        ),
        SimpleNamespace(forward_time_s=0.01),
        0.02,
    )
    for i in range(4):
        deliver(obs, st, 1, 101.0 + i * 0.1)
    st.finish_reason, st.finish_time = FinishReason.LENGTH, 101.5
    obs.on_request_finished(st)
    v = values(obs)
    assert v["splitserve:generation_tokens_total"] == 4
    assert v["splitserve:prompt_tokens_total"] == 5
    assert v["splitserve:time_to_first_token_seconds_count"] == 1
    assert v["splitserve:time_to_first_token_seconds_sum"] == 1.0
    assert v["splitserve:inter_token_latency_seconds_count"] == 3
    assert v["splitserve:time_per_output_token_seconds_sum"] == pytest.approx(0.1)
    assert v["splitserve:e2e_request_latency_seconds_sum"] == 1.5
    assert v["splitserve:request_queue_time_seconds_count"] == 1
    assert v["splitserve:request_success_total|length"] == 1
    assert v["splitserve:request_success_total|abort"] == 0  # every reason present from 0
    assert v["splitserve:step_time_seconds_count|w0"] == 1


def test_migrated_request_keeps_one_ttft_and_errors_skip_latency():
    obs = MetricsObserver()
    st = state()
    obs.on_request_accepted(st)
    deliver(obs, st, 1, 100.5)
    deliver(obs, st, 1, 100.6)
    # the worker is lost; the request resumes elsewhere with its 2 tokens
    deliver(obs, st, 1, 103.0)
    st.finish_reason = FinishReason.ERROR
    obs.on_request_finished(st)
    v = values(obs)
    assert v["splitserve:time_to_first_token_seconds_count"] == 1
    assert v["splitserve:inter_token_latency_seconds_count"] == 2
    assert v["splitserve:request_success_total|error"] == 1
    assert v["splitserve:e2e_request_latency_seconds_count"] == 0


def test_observer_group_forwards_every_hook_even_new_ones():
    calls = []

    class Recorder(EngineObserver):
        def __getattribute__(self, name):
            if name.startswith("on_"):
                return lambda *a: calls.append((name, a))
            return object.__getattribute__(self, name)

    group = ObserverGroup(Recorder(), Recorder())
    group.on_request_rejected("invalid")
    group.on_something_added_later(1)
    assert (
        calls
        == [("on_request_rejected", ("invalid",))] * 2 + [("on_something_added_later", (1,))] * 2
    )


def test_tokens_batch_counts_exactly_as_one_call_per_request():
    """The engine reports a step's deliveries at once; every value moves as with on_tokens."""
    one, batch = MetricsObserver(), MetricsObserver()
    states = {
        o: [state(f"r{i}", prompt=3 + i, arrival=99.0 + i / 10) for i in range(5)]
        for o in (one, batch)
    }
    steps = [  # (time, [(request index, tokens)]): requests join late, one migrates (gap)
        (100.0, [(0, 1), (1, 1)]),
        (100.03, [(0, 1), (1, 1), (2, 3)]),
        (100.06, [(0, 1), (1, 2), (2, 1), (3, 1)]),
        (100.5, [(0, 1), (2, 1), (3, 1), (4, 1)]),
        (100.53, [(1, 1), (4, 2)]),
    ]
    for now, items in steps:
        deliveries = []
        for i, n in items:
            deliver(one, states[one][i], n, now)
            st = states[batch][i]
            st.output_token_ids.extend([7] * n)
            deliveries.append((st, n))
        batch.on_tokens_batch(deliveries, now)
    a, b = values(one), values(batch)
    assert a.keys() == b.keys()
    for key, value in a.items():
        if "_created" in key:
            continue
        assert b[key] == pytest.approx(value, abs=1e-9), key
    assert b["splitserve:generation_tokens_total"] == 19
    assert b["splitserve:inter_token_latency_seconds_count"] == 10


def test_observer_group_skips_hooks_nobody_implements():
    seen = []

    class TokensOnly(EngineObserver):
        def on_tokens(self, state, num_new, now):
            seen.append((state, num_new, now))

    class Nothing(EngineObserver):
        pass

    group = ObserverGroup(TokensOnly(), Nothing())
    group.on_tokens_batch([("a", 1), ("b", 2)], 5.0)  # the default forwards to on_tokens
    assert seen == [("a", 1, 5.0), ("b", 2, 5.0)]
    assert group.on_step.__name__ == "_noop"  # nobody implements it: nothing is called
    quiet = ObserverGroup(Nothing(), Nothing())
    assert quiet.on_tokens_batch.__name__ == "_noop"
