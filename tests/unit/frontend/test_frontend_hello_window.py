"""A front-end apart (SchedulerLink) while its hello waits for the leader's ack: the hello
carries the requests in flight when it was written; what comes or goes after it reaches the
leader once the ack is in. The first request of `splitserve up --schedulers 2 --frontends 2`
came in that window and waited forever (issue #35, problem 7)."""

from __future__ import annotations

import asyncio

import grpc

from common.pb import frontend_link_pb2_grpc
from frontend_svc.leader_finder import FixedLeader
from frontend_svc.scheduler_link import FrontendIdentity, SchedulerLink
from scheduler_svc.core import FinishReason
from scheduler_svc.ha.cluster_view import SchedulerRole
from scheduler_svc.links.frontend_link import FrontendLinkService
from tests.engine_fakes import (
    FakeWorker,
    drain,
    make_engine,
    make_state,
    reference,
    registration,
    run_session,
)


class SlowToAck(FrontendLinkService):
    """Reads a front-end's hello (and answers it) only once `gate` is set."""

    def __init__(self, engine) -> None:
        super().__init__(engine, SchedulerRole(), 512)
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def Connect(self, request_iterator, context):  # noqa: N802
        self.entered.set()  # the front-end's hello is built: it waits for the ack now
        await self.gate.wait()
        await super().Connect(request_iterator, context)


async def with_slow_leader(engine, body) -> None:
    service = SlowToAck(engine)
    server = grpc.aio.server()
    frontend_link_pb2_grpc.add_FrontendLinkServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    link = SchedulerLink(
        FrontendIdentity("fe-test", "localhost", 1),
        "fake",
        FixedLeader(f"127.0.0.1:{port}"),
    )
    try:
        await asyncio.wait_for(body(service, link), 20)
    finally:
        await link.stop()
        await server.stop(0)


def test_a_request_that_arrives_while_the_hello_awaits_its_ack_runs():
    async def main():
        engine = make_engine()
        session = engine.attach(registration("w0"), FakeWorker())
        task = asyncio.create_task(run_session(engine, session))

        async def body(service, link):
            await link.start()
            await service.entered.wait()
            state = make_state("early", [5, 6, 7], 8)
            link.submit(state)  # in no hello
            service.gate.set()
            tokens, deltas = await drain(state)
            assert tokens == reference([5, 6, 7], 8)
            assert deltas[-1].finish_reason == FinishReason.LENGTH

        await with_slow_leader(engine, body)
        session.mark_lost("test over")
        await task

    asyncio.run(main())


def test_a_request_whose_client_left_while_the_hello_awaited_its_ack_is_cancelled():
    async def main():
        engine = make_engine(worker_wait_timeout=600.0)  # no worker: it would wait that long
        resumed: list[str] = []
        resume = engine.resume

        def recording_resume(states):
            resumed.extend(s.request_id for s in states)
            return resume(states)

        engine.resume = recording_resume

        async def body(service, link):
            link.submit(make_state("gone", [5, 6, 7], 8))  # not connected: it goes in the hello
            await link.start()
            await service.entered.wait()
            link.drop("gone")  # no link to say so yet
            service.gate.set()
            await asyncio.wait_for(link.connected.wait(), 10)
            while "gone" in engine.requests or not engine.frontends:
                await asyncio.sleep(0.01)
            assert resumed == ["gone"]

        await with_slow_leader(engine, body)

    asyncio.run(main())
