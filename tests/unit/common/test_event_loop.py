"""The services' event loop choice: uvloop by default when installed, asyncio on request."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common import event_loop


async def health_round_trip() -> tuple[str, int]:
    """A gRPC aio server and client on the running loop (grpc.aio must work on either loop)."""
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
        return event_loop.loop_name(), reply.status
    finally:
        await server.stop(0)


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_grpc_serves_on_each_loop(kind):
    name, status = event_loop.run(health_round_trip(), kind)
    assert name == kind
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_auto_prefers_uvloop_when_installed():
    pytest.importorskip("uvloop")
    assert event_loop.run(asyncio.sleep(0, "x"), "auto") == "x"
    assert event_loop.loop_factory("auto") is not None
    assert event_loop.loop_factory("asyncio") is None


def test_an_unknown_loop_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="auto, uvloop, asyncio"):
        event_loop.loop_factory("trio")
