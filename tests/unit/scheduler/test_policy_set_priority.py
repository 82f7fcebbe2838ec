"""Changing a waiting request's priority (gRPC SetPriority, HTTP POST /v1/requests/{id}/priority):
the queue reorders; NOT_FOUND for an unknown id; FAILED_PRECONDITION once it runs."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from common.pb import generation_pb2 as pb
from common.tokenizer import load_tokenizer
from frontend_svc.generation_service import GenerationService
from frontend_svc.http import create_app
from frontend_svc.intake import Intake
from scheduler_svc.engine.priority_change import PriorityChangeError, set_priority
from tests.engine_fakes import FakeWorker, http_context, make_engine, make_state, registration


class Aborted(Exception):
    pass


class FakeContext:
    async def abort(self, code, message):
        raise Aborted(code, message)


def submit(engine, rid: str, priority: int) -> None:
    state = make_state(rid, [1, 2, 3], 4)
    state.priority = priority
    engine.submit(state)


def order(queue) -> list[str]:
    return [r.request_id for r in queue]


def test_reorders_the_global_queue_and_a_workers_local_queue():
    async def main():
        engine = make_engine(scheduling_policy="priority")
        for rid, prio in (("a", 1), ("b", 2), ("c", 3)):
            submit(engine, rid, prio)
        assert order(engine.waiting) == ["a", "b", "c"]
        set_priority(engine, "c", 0)
        assert order(engine.waiting) == ["c", "a", "b"]
        assert engine.requests["c"].priority == 0 and engine.waiting.get("c").priority == 0
        # handed to a worker but not admitted yet: still waiting, in its local queue
        session = engine.attach(registration("w"), FakeWorker())
        assert not engine.waiting and order(session.scheduler.waiting) == ["c", "a", "b"]
        set_priority(engine, "b", -1)
        assert order(session.scheduler.waiting) == ["b", "c", "a"]
        with pytest.raises(PriorityChangeError) as info:
            set_priority(engine, "zz", 0)
        assert info.value.code == "NOT_FOUND"
        session.scheduler.schedule()  # admits them: running now
        with pytest.raises(PriorityChangeError, match="no longer waiting") as info:
            set_priority(engine, "b", 5)
        assert info.value.code == "FAILED_PRECONDITION"
        with pytest.raises(PriorityChangeError) as info:
            set_priority(engine, "a", 10**9)
        assert info.value.code == "INVALID_ARGUMENT"

    asyncio.run(main())


def test_fcfs_keeps_arrival_order_but_records_the_priority():
    async def main():
        engine = make_engine()
        for rid in ("a", "b"):
            submit(engine, rid, 0)
        set_priority(engine, "b", -3)
        assert order(engine.waiting) == ["a", "b"] and engine.waiting.get("b").priority == -3

    asyncio.run(main())


def test_grpc_set_priority_status_codes():
    async def main():
        engine = make_engine(scheduling_policy="priority")
        service = GenerationService(engine.client, intake=None)
        submit(engine, "a", 1)
        submit(engine, "b", 2)
        reply = await service.SetPriority(
            pb.SetPriorityRequest(request_id="b", priority=0), FakeContext()
        )
        assert isinstance(reply, pb.SetPriorityResponse)
        assert order(engine.waiting) == ["b", "a"]
        with pytest.raises(Aborted) as info:
            await service.SetPriority(pb.SetPriorityRequest(request_id="nope"), FakeContext())
        assert info.value.args[0] == grpc.StatusCode.NOT_FOUND
        session = engine.attach(registration("w"), FakeWorker())
        session.scheduler.schedule()
        with pytest.raises(Aborted) as info:
            await service.SetPriority(
                pb.SetPriorityRequest(request_id="a", priority=0), FakeContext()
            )
        assert info.value.args[0] == grpc.StatusCode.FAILED_PRECONDITION

    asyncio.run(main())


def test_http_route():
    tok = load_tokenizer(None)

    async def main():
        engine = make_engine(scheduling_policy="priority")
        ctx = http_context(engine, Intake(tok, "fake", {"fake"}, 512))
        transport = httpx.ASGITransport(app=create_app(ctx))
        submit(engine, "a", 1)
        submit(engine, "b", 2)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            r = await client.post("/v1/requests/b/priority", json={"priority": -1})
            assert r.status_code == 200 and r.json() == {"request_id": "b", "priority": -1}
            assert order(engine.waiting) == ["b", "a"]
            r = await client.post("/v1/requests/nope/priority", json={"priority": 0})
            assert r.status_code == 404 and "no request" in r.json()["error"]["message"]
            r = await client.post("/v1/requests/a/priority", json={"priority": "high"})
            assert r.status_code == 400
            session = engine.attach(registration("w"), FakeWorker())
            session.scheduler.schedule()
            r = await client.post("/v1/requests/a/priority", json={"priority": 0})
            assert r.status_code == 409 and r.json()["error"]["code"] == "failed_precondition"

    asyncio.run(main())
