"""The scheduler's worker link over loopback gRPC: the leader's epoch on the RegisterAck and
every Step, the real request id on NewRequest, a worker's held rows parsed from Register, and
a worker that follows a newer leader refused."""

from __future__ import annotations

import asyncio

import grpc

from common.pb import worker_link_pb2 as pb
from common.pb import worker_link_pb2_grpc as pb_grpc
from scheduler_svc.engine.worker_session import HeldRequest
from scheduler_svc.links.worker_link import WorkerLinkService
from tests.engine_fakes import make_engine, make_state


def register(**fields) -> pb.WorkerMessage:
    return pb.WorkerMessage(
        register=pb.Register(
            worker_id="w1",
            model="fake",
            block_size=4,
            num_device_blocks=64,
            max_model_len=512,
            vocab_size=1000,
            **fields,
        )
    )


async def attached(registrations: list) -> list:
    """The registrations once the link has attached the worker: the ack is written first, so a
    client that has read it may be a turn of the loop ahead of the attach (with_link bounds it)."""
    while not registrations:
        await asyncio.sleep(0.001)
    return registrations


async def with_link(epoch: int, body) -> None:
    engine = make_engine()
    registrations = []
    attach = engine.attach

    def recording_attach(registration, transport):
        registrations.append(registration)
        return attach(registration, transport)

    engine.attach = recording_attach
    server = grpc.aio.server()
    pb_grpc.add_WorkerLinkServicer_to_server(WorkerLinkService(engine, lambda: epoch), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await asyncio.wait_for(body(engine, pb_grpc.WorkerLinkStub(channel), registrations), 10)
    finally:
        await server.stop(0)


def test_the_leaders_epoch_is_on_the_ack_and_every_step_and_held_rows_are_parsed():
    async def body(engine, stub, registrations):
        call = stub.Connect()
        held = pb.HeldRequest(request_id="gone", block_ids=[3, 4], num_computed_tokens=6)
        held.num_tokens = 7
        await call.write(register(epoch=5, held=[held]))
        reply = await call.read()
        assert reply.register_ack.epoch == 7 and reply.register_ack.worker_id == "w1"
        [reg] = await attached(registrations)
        assert reg.epoch == 5 and reg.held == [HeldRequest("gone", [3, 4], 6, 7)]
        engine.submit(make_state("req-1", [4, 5, 6], 2))
        steps = []
        while len(steps) < 2:
            msg = await call.read()
            if msg.WhichOneof("msg") != "step":
                continue
            step = msg.step
            steps.append(step)
            result = pb.StepResult(step_id=step.step_id)
            for new in step.new_requests:
                result.sampled_handles.append(new.handle)
                result.sampled_token_ids.append(9)
            for handle in step.running.handles:
                result.sampled_handles.append(handle)
                result.sampled_token_ids.append(10)
            await call.write(pb.WorkerMessage(step_result=result))
        assert [s.epoch for s in steps] == [7, 7]
        assert [n.request_id for n in steps[0].new_requests] == ["req-1"]
        call.cancel()

    asyncio.run(with_link(7, body))


def test_a_worker_that_accepted_a_newer_leader_is_refused():
    async def body(engine, stub, registrations):
        call = stub.Connect()
        await call.write(register(epoch=8))
        try:
            msg = await call.read()
            assert msg is grpc.aio.EOF
        except grpc.aio.AioRpcError:
            pass
        assert await call.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert await call.details() == "a newer leader (epoch 8) exists"
        assert not registrations and not engine.sessions

    asyncio.run(with_link(7, body))


def test_without_etcd_the_epoch_is_zero_everywhere():
    async def body(engine, stub, registrations):
        call = stub.Connect()
        await call.write(register())
        reply = await call.read()
        assert reply.register_ack.epoch == 0 and (await attached(registrations))[0].held == []
        call.cancel()

    asyncio.run(with_link(0, body))
