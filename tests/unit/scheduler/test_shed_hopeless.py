"""--shed-hopeless: a request that cannot make its deadline ends at once with the documented
status (docs/scheduling.md): RESOURCE_EXHAUSTED over gRPC, 429 over HTTP, before any output."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from common.pb import generation_pb2 as pb
from common.pb import sampling_pb2
from frontend_svc.generation_service import GenerationService
from frontend_svc.intake import Intake
from scheduler_svc.core import FinishReason
from tests.engine_fakes import (
    TOKENIZER_VOCAB,
    FakeWorker,
    drain,
    make_engine,
    make_state,
    registration,
    run_session,
)
from tests.unit.frontend.test_http_api import MODEL, TOK, run
from tests.unit.scheduler.test_policy_set_priority import Aborted, FakeContext


def test_hopeless_request_ends_at_once_with_resource_exhausted():
    async def main():
        engine = make_engine(TOKENIZER_VOCAB, scheduling_policy="goodput", shed_hopeless=True)
        session = engine.attach(registration("w"), FakeWorker(vocab_size=TOKENIZER_VOCAB))
        task = asyncio.create_task(run_session(engine, session))
        hopeless = make_state("late", [1, 2, 3, 4], 400)  # 400 decode steps: seconds
        hopeless.deadline = time.monotonic() + 0.05
        fine = make_state("fine", [5, 6, 7, 8], 4)
        fine.deadline = time.monotonic() + 60
        started = time.monotonic()
        engine.submit(hopeless)
        engine.submit(fine)
        (late_tokens, late_deltas), (fine_tokens, fine_deltas) = await asyncio.gather(
            drain(hopeless), drain(fine)
        )
        waited = time.monotonic() - started
        session.mark_lost("test over")
        await task
        return late_tokens, late_deltas, fine_tokens, fine_deltas, waited

    late_tokens, late_deltas, fine_tokens, fine_deltas, waited = asyncio.run(main())
    assert late_tokens == [] and waited < 5
    assert late_deltas[-1].finish_reason is FinishReason.ERROR
    assert late_deltas[-1].error_code == "RESOURCE_EXHAUSTED"
    assert "deadline" in late_deltas[-1].error
    assert len(fine_tokens) == 4 and fine_deltas[-1].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize(
    ("target", "named"),
    [
        ("deadline", "can no longer meet its deadline"),
        ("ttft", "can no longer meet its time-to-first-token target"),
        ("tpot", "can no longer meet its time-per-output-token target"),
    ],
)
def test_shed_message_names_the_target_missed(target, named):
    async def main():
        engine = make_engine(TOKENIZER_VOCAB, scheduling_policy="goodput", shed_hopeless=True)
        session = engine.attach(registration("w"), FakeWorker(vocab_size=TOKENIZER_VOCAB))
        task = asyncio.create_task(run_session(engine, session))
        hopeless = make_state("late", [1, 2, 3, 4], 400)
        if target == "deadline":
            hopeless.deadline = time.monotonic() + 0.05
        elif target == "ttft":
            hopeless.ttft_target_s = 1e-6  # before the prompt's prefill can end
        else:
            hopeless.tpot_target_s = 1e-6  # faster than any decode step
        engine.submit(hopeless)
        _, deltas = await drain(hopeless)
        session.mark_lost("test over")
        await task
        return deltas[-1]

    last = asyncio.run(main())
    assert last.error_code == "RESOURCE_EXHAUSTED"
    assert named in last.error


def complete(max_tokens: int, deadline: float, **engine_options):
    """One completion with a deadline through the in-process HTTP app: (status, body)."""

    async def body(client, ctx):
        r = await client.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "Hello world",
                "max_tokens": max_tokens,
                "temperature": 0,
                "deadline": deadline,
            },
        )
        return r.status_code, r.json()

    return run(body, scheduling_policy="goodput", **engine_options)


def test_hopeless_request_is_429_over_http():
    status, out = complete(400, 0.05, shed_hopeless=True)
    assert status == 429, out
    assert out["error"]["code"] == "resource_exhausted"
    assert "deadline" in out["error"]["message"]


def test_without_the_flag_the_hopeless_request_is_served_late():
    assert complete(8, 0.0001)[0] == 200


def test_deadlines_met_and_missed_reach_metrics_and_dashboard():
    async def body(client, ctx):
        common = {"model": MODEL, "prompt": "Hello world", "temperature": 0}
        ok = await client.post("/v1/completions", json={**common, "max_tokens": 4, "deadline": 60})
        # due as it arrives: hopeless whatever the fake worker's measured steps cost
        shed = await client.post(
            "/v1/completions", json={**common, "max_tokens": 400, "deadline": 1e-6}
        )
        metrics = (await client.get("/metrics")).text
        state = (await client.get("/dashboard/api/state")).json()
        return ok.status_code, shed.status_code, metrics, state

    ok, shed, metrics, state = run(body, scheduling_policy="goodput", shed_hopeless=True)
    assert (ok, shed) == (200, 429)
    assert 'splitserve:deadline_requests_total{priority="0",tenant=""} 2.0' in metrics
    assert 'splitserve:deadline_met_total{priority="0",tenant=""} 1.0' in metrics
    assert 'splitserve:deadline_met_ratio{priority="0",tenant=""} 0.5' in metrics
    assert "splitserve:output_length_prediction_abs_error_tokens" in metrics
    assert state["deadlines"] == [{"tenant": "", "priority": 0, "met": 1, "of": 2, "rate": 0.5}]
    assert state["goodput_per_s"] > 0


def test_hopeless_request_is_resource_exhausted_over_grpc():
    async def main():
        engine = make_engine(TOKENIZER_VOCAB, scheduling_policy="goodput", shed_hopeless=True)
        session = engine.attach(registration("w"), FakeWorker(vocab_size=TOKENIZER_VOCAB))
        task = asyncio.create_task(run_session(engine, session))
        service = GenerationService(engine.client, Intake(TOK, MODEL, {MODEL}, 512))
        request = pb.GenerateRequest(
            text="Hello world",
            sampling=sampling_pb2.SamplingParams(max_tokens=400, temperature=0.0),
            deadline_s=0.05,
        )
        try:
            with pytest.raises(Aborted) as info:
                async for _ in service.Generate(request, FakeContext()):
                    pass
        finally:
            session.mark_lost("test over")
            await task
        return info.value.args

    code, message = asyncio.run(main())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "deadline" in message


def test_goodput_costs_follow_the_measured_step_time_and_the_live_workers():
    async def main():
        engine = make_engine(TOKENIZER_VOCAB, scheduling_policy="goodput")
        default = engine.policy.costs
        sessions = [
            engine.attach(registration(w), FakeWorker(vocab_size=TOKENIZER_VOCAB))
            for w in ("a", "b")
        ]
        tasks = [asyncio.create_task(run_session(engine, s)) for s in sessions]
        states = [make_state(f"r{k}", [1, 2, 3, 4 + k], 6) for k in range(4)]
        for state in states:
            engine.submit(state)
        await asyncio.gather(*(drain(s) for s in states))
        a, b = engine.slo.steps.coefficients()
        costs, workers = engine.policy.costs, engine.policy.num_workers
        for s in sessions:
            s.mark_lost("test over")
        await asyncio.gather(*tasks)
        return default, costs, workers, a, b

    default, costs, workers, a, b = asyncio.run(main())
    assert costs != default
    assert costs.prefill_s_per_token == pytest.approx(b)
    assert costs.decode_s_per_token == pytest.approx(a + b)
    assert workers == 2


def test_ttft_and_tpot_targets_per_request_and_per_tenant_reach_goodput_and_metrics():
    async def body(client, ctx):
        common = {"model": MODEL, "prompt": "Hello world", "temperature": 0}
        own = await client.post(
            "/v1/completions", json={**common, "max_tokens": 400, "ttft_target_s": 0.0001}
        )
        by_tenant = await client.post(
            "/v1/completions", json={**common, "max_tokens": 400, "tenant": "t"}
        )
        paced = await client.post(
            "/v1/completions", json={**common, "max_tokens": 4, "tpot_target_s": 60}
        )
        metrics = (await client.get("/metrics")).text
        return own.status_code, by_tenant.status_code, paced.status_code, metrics

    own, by_tenant, paced, metrics = run(
        body,
        scheduling_policy="goodput",
        shed_hopeless=True,
        tenant_ttft_targets="t:0.0001",
    )
    assert (own, by_tenant, paced) == (429, 429, 200)
    assert 'splitserve:deadline_requests_total{priority="0",tenant=""} 2.0' in metrics
    assert 'splitserve:deadline_met_total{priority="0",tenant=""} 1.0' in metrics
    assert 'splitserve:deadline_requests_total{priority="0",tenant="t"} 1.0' in metrics


def test_targets_travel_over_grpc_into_the_core_request():
    from frontend_svc.intake import FieldRejected
    from splitserve.embedded import in_flight_record

    intake = Intake(TOK, MODEL, {MODEL}, 512)
    req = pb.GenerateRequest(
        text="Hello world",
        sampling=sampling_pb2.SamplingParams(max_tokens=4),
        ttft_target_s=0.5,
        tpot_target_s=0.05,
    )
    core = in_flight_record(intake.build(req), sink=None).to_core_request()
    assert core.ttft_deadline == pytest.approx(core.arrival_time + 0.5)
    assert core.tpot_target_s == 0.05
    with pytest.raises(FieldRejected):
        intake.build(pb.GenerateRequest(text="x", tpot_target_s=-1.0))


def test_a_hopeless_request_in_the_global_queue_is_shed_too():
    async def main():
        engine = make_engine(TOKENIZER_VOCAB, scheduling_policy="goodput", shed_hopeless=True)
        hopeless = make_state("late", [1, 2, 3, 4], 400)  # no worker yet: the global queue
        hopeless.deadline = time.monotonic() + 0.05
        fine = make_state("fine", [5, 6, 7, 8], 4)
        fine.deadline = time.monotonic() + 60
        engine.submit(hopeless)
        engine.submit(fine)
        engine.policy.refresh(time.monotonic())  # what a worker's step does
        engine.shed_hopeless_waiting()
        tokens, deltas = await drain(hopeless)
        left = [r.request_id for r in engine.waiting]
        engine.abort("fine")
        return tokens, deltas, left

    tokens, deltas, left = asyncio.run(main())
    assert tokens == [] and deltas[-1].error_code == "RESOURCE_EXHAUSTED"
    assert left == ["fine"]
