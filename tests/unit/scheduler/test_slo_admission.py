"""SLO admission: refuse when the predicted TTFT misses the target, accept otherwise; thrash
backpressure: the recompute ratio over a window, the pause, its log line and metrics."""

from __future__ import annotations

import pytest

from scheduler_svc.core import Request, Scheduler
from scheduler_svc.engine.slo_admission import (
    SloAdmission,
    StepTimeModel,
    ThrashMonitor,
    tokens_ahead,
)
from scheduler_svc.engine.tenant_admission import Overloaded
from tests.factories import request, scheduler_factory


def req(rid: str, n: int, priority: int = 0, arrival: float = 0.0) -> Request:
    return request(rid, [5] * n, max_tokens=8, priority=priority, arrival=arrival)


_make = scheduler_factory(num_blocks=4096, max_model_len=4096)


def sched(policy: str = "fcfs", budget: int = 256) -> Scheduler:
    return _make(max_num_batched_tokens=budget, policy=policy)


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict]] = []

    def warning(self, event, **kw):
        self.lines.append(("warning", event, kw))

    def info(self, event, **kw):
        self.lines.append(("info", event, kw))


def test_step_time_model_fits_a_line_and_stays_sane():
    m = StepTimeModel()
    assert not m.ready
    for tokens in (16, 64, 256, 32, 128):
        m.add(tokens, 0.01 + 1e-4 * tokens)
    a, b = m.coefficients()
    assert a == pytest.approx(0.01) and b == pytest.approx(1e-4)
    same = StepTimeModel()
    for _ in range(5):
        same.add(100, 0.05)  # one size only: proportional
    assert same.predict(200) == pytest.approx(0.1)


def test_refuses_when_the_queue_ahead_misses_the_target_and_accepts_otherwise():
    s = sched()
    slo = SloAdmission(ttft_slo_s=0.5)
    assert slo.predict_ttft(req("x", 100), [s.waiting], [s]) is None  # nothing measured yet
    slo.check(req("x", 100), [s.waiting], [s])  # so nothing is refused
    for tokens in (64, 256):
        slo.steps.add(tokens, 0.02 + tokens * 3.125e-4)  # a full step of 256 takes 0.1 s
    assert slo.predict_ttft(req("x", 100), [s.waiting], [s]) == pytest.approx(0.02 + 100 * 3.125e-4)
    for i in range(10):
        s.add_request(req(f"q{i}", 256, arrival=i))  # 2560 tokens ahead: 10 full steps
    predicted = slo.predict_ttft(req("x", 100, arrival=99), [s.waiting], [s])
    assert predicted == pytest.approx((2560 + 100) / 256 * 0.1)
    with pytest.raises(Overloaded) as info:
        slo.check(req("x", 100, arrival=99), [s.waiting], [s])
    assert info.value.code == "RESOURCE_EXHAUSTED"
    # counting stops once the target is certainly missed: "at least"
    assert "predicted time to first token (at least " in str(info.value)
    assert 0 < info.value.retry_after_s <= predicted - 0.5
    assert slo.num_refused_slo == 1
    SloAdmission(ttft_slo_s=2.0, log=None).check(req("y", 100), [s.waiting], [s])  # would wait ~1 s


def test_only_requests_that_would_run_first_count_as_ahead():
    s = sched("priority")
    for i in range(10):
        s.add_request(req(f"low{i}", 256, priority=5, arrival=i))
    urgent, normal = req("u", 50, priority=0, arrival=99), req("n", 50, priority=5, arrival=99)
    assert tokens_ahead(s.waiting, urgent) == 0
    assert tokens_ahead(s.waiting, normal) == 2560
    assert tokens_ahead(s.waiting, normal, limit=600) <= 768  # stops counting early
    slo = SloAdmission(ttft_slo_s=0.5)
    slo.steps.add(256, 0.1)
    slo.check(urgent, [s.waiting], [s])
    with pytest.raises(Overloaded):
        slo.check(normal, [s.waiting], [s])


def test_running_decodes_take_budget_and_prefill_in_progress_counts():
    s = sched(budget=64)
    for i in range(4):
        s.add_request(req(f"r{i}", 100, arrival=i))
    s.schedule()  # 64 of r0's 100 tokens: r0 runs, mid-prefill
    slo = SloAdmission(ttft_slo_s=10.0)
    slo.steps.add(64, 0.064)  # 1 ms per token
    p = slo.predict_ttft(req("x", 10, arrival=9), [s.waiting], [s])
    # ahead: r0's 36 + r1..r3's 300 + own 10; 63 prefill tokens per step beside one decode
    assert p == pytest.approx((36 + 300 + 10) / 63 * 0.064)


def test_thrash_ratio_window_pause_and_recovery():
    now = [0.0]
    log = Log()
    mon = ThrashMonitor(threshold=0.2, window_s=10.0, clock=lambda: now[0], log=log, min_tokens=0)
    mon.add(recomputed=0, scheduled=1000)
    assert mon.ratio() == 0.0 and not mon.thrashing
    now[0] = 1.0
    mon.add(recomputed=300, scheduled=600)  # 300 / (1600 - 300)
    assert mon.ratio() == pytest.approx(300 / 1300)
    assert mon.thrashing and mon.num_episodes == 1 and mon.first_at == 1.0
    assert log.lines[0][:2] == ("warning", "kv_cache_thrashing")
    assert "23% of newly computed tokens" in log.lines[0][2]["reason"]
    now[0] = 10.5  # the first sample leaves the window: 300 / 300
    assert mon.ratio() == pytest.approx(1.0)
    now[0] = 11.5  # both gone: over
    assert mon.update() is False and log.lines[-1][1] == "kv_cache_thrashing_over"


def test_window_keeps_enough_tokens_on_a_slow_worker():
    now = [0.0]
    mon = ThrashMonitor(threshold=0.2, window_s=1.0, clock=lambda: now[0], min_tokens=2048)
    for t in range(8):
        now[0] = float(t)
        mon.add(recomputed=100 if t == 0 else 0, scheduled=300)
    # 2400 tokens in 8 s: the 1 s window stretches back to keep >= 2048 of them
    assert mon.scheduled >= 2048 and mon.recomputed == 0
    assert mon.ratio() == 0.0


def test_backpressure_refuses_with_the_reason_and_metrics_show_it():
    from scheduler_svc.obs.metrics import MetricsObserver
    from tests.engine_fakes import make_engine
    from tests.unit.scheduler.test_metrics import values

    engine = make_engine(thrash_backpressure=True, ttft_slo_ms=100.0)
    slo = engine.slo
    slo.thrash.min_tokens = 0
    slo.thrash.add(recomputed=500, scheduled=1000)
    assert slo.paused
    with pytest.raises(Overloaded, match="admission is paused: recomputed tokens are 100%") as info:
        slo.check(req("x", 10), [engine.waiting], [])
    assert info.value.retry_after_s == 5.0
    v = values(MetricsObserver(engine))
    assert v["splitserve:kv_thrash_ratio"] == 1.0
    assert v["splitserve:kv_thrashing"] == 1 and v["splitserve:admission_paused"] == 1
    assert v["splitserve:kv_thrash_episodes_total"] == 1
    assert v["splitserve:admission_refused_total|thrash"] == 1
    # without backpressure the signal still fires, but nothing is refused
    quiet = SloAdmission(backpressure=False)
    quiet.thrash.min_tokens = 0
    quiet.thrash.add(500, 1000)
    assert quiet.thrash.thrashing and not quiet.paused
    quiet.check(req("x", 10), [], [])


def test_engine_refuses_over_the_ttft_target_with_retry_after():
    from tests.engine_fakes import FakeWorker, make_engine, make_state, registration

    engine = make_engine(ttft_slo_ms=500.0, worker_queue_depth=64)
    engine.attach(registration("w", num_blocks=4096), FakeWorker())  # no step loop: all queue
    engine.slo.steps.add(64, 0.1)  # budget 64: 0.1 s per full step
    accepted = 0
    with pytest.raises(Overloaded) as info:
        for i in range(50):
            engine.submit(make_state(f"r{i}", [1] * 60, 4))
            accepted += 1
    # each request adds 60 tokens ahead: ~0.1 s; the target (0.5 s) allows about five
    assert 3 <= accepted <= 6
    assert info.value.retry_after_s > 0 and "over the target of 500 ms" in str(info.value)
    assert f"r{accepted}" not in engine.requests
