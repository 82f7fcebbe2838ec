"""A worker's capacity in its Register (rows, tokens per step, model length) and the limits the
scheduler schedules it within: the smaller of its own flag and the worker's, logged once."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from scheduler_svc.engine import worker_limits
from scheduler_svc.engine.worker_session import WorkerRegistration
from tests.engine_fakes import FakeWorker, make_engine, registration
from tests.unit.scheduler.test_worker_link_epoch import attached, register, with_link

# make_engine's own limits: max_num_seqs 8, max_num_batched_tokens 64, max_model_len 512


def capacity(wid: str, **limits) -> WorkerRegistration:
    return dataclasses.replace(registration(wid), **limits)


class Recorder:
    """Stands in for the module's logger: structlog may have cached the real one already
    (configure_logging caches on first use), where capture_logs would see nothing."""

    def __init__(self) -> None:
        self.lines: list[dict] = []

    def info(self, event: str, **kw) -> None:
        self.lines.append({"event": event, **kw})


@pytest.fixture(autouse=True)
def recorder(monkeypatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(worker_limits, "log", rec)
    return rec


def attach_logged(engine, reg: WorkerRegistration) -> tuple:
    lines = worker_limits.log.lines  # type: ignore[attr-defined]
    lines.clear()
    session = engine.attach(reg, FakeWorker())
    [line] = [e for e in lines if e["event"] == "worker_limits"]
    return session.scheduler.config, line


def test_a_worker_with_smaller_limits_is_scheduled_within_its_own():
    async def main():
        engine = make_engine()
        reg = capacity("small", max_num_seqs=3, max_num_batched_tokens=32, max_model_len=100)
        cfg, line = attach_logged(engine, reg)
        assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len) == (3, 32, 100)
        assert line["worker_id"] == "small"
        assert (line["max_num_seqs"], line["max_num_seqs_from"]) == (3, "worker")
        assert (line["max_num_batched_tokens"], line["max_num_batched_tokens_from"]) == (
            32,
            "worker",
        )
        assert (line["max_model_len"], line["max_model_len_from"]) == (100, "worker")

    asyncio.run(main())


def test_a_larger_worker_gets_the_schedulers_limits_and_zero_means_not_reported():
    async def main():
        engine = make_engine()
        big = capacity("big", max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=8192)
        for reg in (big, registration("old")):  # "old": 0 = an older or simulated worker
            cfg, line = attach_logged(engine, reg)
            assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len) == (8, 64, 512)
            assert {line[k + "_from"] for k in ("max_num_seqs", "max_num_batched_tokens")} == {
                "scheduler"
            }
            assert line["max_model_len_from"] == "scheduler"  # a tie is the scheduler's

    asyncio.run(main())


def test_limits_mix_per_field():
    async def main():
        engine = make_engine()
        cfg, line = attach_logged(engine, capacity("mixed", max_num_seqs=4))
        assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (4, 64)
        assert line["max_num_seqs_from"] == "worker"
        assert line["max_num_batched_tokens_from"] == "scheduler"

    asyncio.run(main())


def test_default_flags_keep_the_schedulers_128_and_2048():
    """The worker's defaults (256 rows, 8192 tokens) are above the scheduler's: behaviour with
    default flags is the scheduler's, as before the worker reported them."""
    from scheduler_svc.config import SchedulerServiceConfig
    from worker_svc.config import ModelRunnerConfig

    runner = ModelRunnerConfig()
    reg = capacity(
        "w",
        max_num_seqs=runner.max_num_seqs,
        max_num_batched_tokens=runner.max_num_batched_tokens,
    )
    limits = worker_limits.WorkerLimits.of(SchedulerServiceConfig(), reg)
    assert limits.max_num_seqs == worker_limits.Limit(128, "scheduler")
    assert limits.max_num_batched_tokens == worker_limits.Limit(2048, "scheduler")


def test_a_worker_no_configuration_fits_is_refused_with_a_sentence():
    engine = make_engine()
    reg = capacity("broken", num_device_blocks=0)
    problem = worker_limits.check(engine.config, reg)
    assert problem is not None and "'broken'" in problem and "num_blocks" in problem
    with pytest.raises(worker_limits.WorkerLimitsError):
        worker_limits.scheduler_config(engine.config, reg)
    assert worker_limits.check(engine.config, registration("fine")) is None


def test_register_carries_the_capacity_over_grpc_and_the_ack_the_length_used():
    async def body(engine, stub, registrations):
        call = stub.Connect()
        message = register(max_num_seqs=2, max_num_batched_tokens=16)
        message.register.max_model_len = 300
        await call.write(message)
        reply = await call.read()
        assert reply.register_ack.max_model_len == 300
        [reg] = await attached(registrations)
        assert (reg.max_num_seqs, reg.max_num_batched_tokens) == (2, 16)
        session = engine.sessions["w1"]
        cfg = session.scheduler.config
        assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len) == (2, 16, 300)
        call.cancel()

    asyncio.run(with_link(0, body))
