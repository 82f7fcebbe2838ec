"""An outsider who knows the ports and the public .proto files, and nothing else: each attack of
issue #35 as a function that tries every way in (plaintext, TLS without a client certificate,
TLS with a certificate of its own CA) and returns what it got. tests/e2e/test_attacks.py runs
them against real clusters while honest clients stream."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import grpc

from common.credentials import SCHEDULER_NAME, Credentials
from common.pb import frontend_link_pb2 as fpb
from common.pb import frontend_link_pb2_grpc, worker_link_pb2_grpc
from common.pb import generation_pb2 as gen_pb
from common.pb import worker_link_pb2 as wpb

ATTEMPT_TIMEOUT_S = 5.0


def ways_in(rogue: Path) -> dict[str, grpc.ChannelCredentials | None]:
    """How an outsider can dial a gRPC port: in clear, TLS trusting anything it is shown but
    with no certificate of its own, TLS with a client certificate of a CA it made (`rogue`:
    the directory of a role of another cluster)."""
    own = Credentials.load(rogue)
    return {
        "plaintext": None,
        "tls without a client certificate": grpc.ssl_channel_credentials(own.ca),
        "tls with its own CA's certificate": own.channel_credentials(),
    }


def _channel(target: str, creds: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
    if creds is None:
        return grpc.aio.insecure_channel(target)
    options = [("grpc.ssl_target_name_override", SCHEDULER_NAME)]
    return grpc.aio.secure_channel(target, creds, options=options)


async def _first_answer(call, *messages) -> str:
    """Send the messages; what the server said first: a message kind, or the status that
    ended the call."""
    try:
        for message in messages:
            await asyncio.wait_for(call.write(message), ATTEMPT_TIMEOUT_S)
        reply = await asyncio.wait_for(call.read(), ATTEMPT_TIMEOUT_S)
        return "eof" if reply is grpc.aio.EOF else reply.WhichOneof("msg")
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    except asyncio.InvalidStateError:  # the call ended before all could be written
        return (await call.code()).name
    except TimeoutError:
        return "no answer"
    finally:
        call.cancel()


async def rogue_worker(target: str, rogue: Path, model: str) -> dict[str, str]:
    """Register as `worker-0` (the id `up` gives its first worker) to be sent prompts."""
    register = wpb.WorkerMessage(
        register=wpb.Register(
            worker_id="worker-0",
            model=model,
            block_size=16,
            num_device_blocks=4096,
            max_model_len=4096,
            vocab_size=49152,
        )
    )
    outcome = {}
    for way, creds in ways_in(rogue).items():
        async with _channel(target, creds) as channel:
            call = worker_link_pb2_grpc.WorkerLinkStub(channel).Connect()
            outcome[way] = await _first_answer(call, register)
    return outcome


async def rogue_frontend(target: str, rogue: Path, victim_ids: list[str]) -> dict[str, str]:
    """Say hello as a front-end that has the victims' requests in flight (to take them over),
    then cancel them; and ask to reprioritise one."""
    taken = [fpb.SubmitRequest(request_id=r, prompt_token_ids=[1, 2, 3]) for r in victim_ids]
    hello = fpb.FrontendMessage(hello=fpb.FrontendHello(frontend_id="frontend-0", in_flight=taken))
    outcome = {}
    for way, creds in ways_in(rogue).items():
        async with _channel(target, creds) as channel:
            stub = frontend_link_pb2_grpc.FrontendLinkStub(channel)
            answer = await _first_answer(stub.Connect(), hello)
            cancels = [
                fpb.FrontendMessage(cancel=fpb.CancelRequest(request_id=r)) for r in victim_ids
            ]
            await _first_answer(stub.Connect(), *cancels)
            raise_first = gen_pb.SetPriorityRequest(request_id=victim_ids[0], priority=-100)
            try:
                await stub.SetPriority(raise_first, timeout=ATTEMPT_TIMEOUT_S)
                reprioritised = "done"
            except grpc.aio.AioRpcError as exc:
                reprioritised = exc.code().name
            outcome[way] = f"hello: {answer}, set priority: {reprioritised}"
    return outcome


async def rogue_etcd(endpoint: str, rogue: Path, rogue_leader: str) -> dict[str, str]:
    """Read the leader key (the map of the cluster), then delete it and write one naming the
    attacker's own server: what an outsider needs to become the leader workers follow."""
    import aetcd

    from common.etcd_client import EtcdClient

    host, _, port = endpoint.rpartition(":")
    own = Credentials.load(rogue)
    clients = {
        "plaintext": lambda: aetcd.Client(host, int(port), timeout=ATTEMPT_TIMEOUT_S),
        "tls with its own CA's certificate": lambda: EtcdClient(
            host, int(port), own, timeout=ATTEMPT_TIMEOUT_S
        ),
    }
    key = b"/splitserve/leader"
    address = rogue_leader.encode()
    info = b'{"worker_address": "%s", "frontend_address": "%s"}' % (address, address)
    value = b'{"member_id": "rogue", "info": %s}' % info
    outcome = {}
    for way, make in clients.items():
        got = []
        client = make()
        try:
            for name, act in (
                ("read", lambda c: c.get(key)),
                ("delete", lambda c: c.delete(key)),
                (
                    "write",
                    lambda c: c.put(key, value % (rogue_leader.encode(), rogue_leader.encode())),
                ),
            ):
                try:
                    await asyncio.wait_for(act(client), ATTEMPT_TIMEOUT_S)
                    got.append(f"{name}: done")
                except Exception as exc:  # noqa: BLE001 - every refusal is an outcome
                    got.append(f"{name}: refused ({type(exc).__name__})")
        finally:
            try:
                await asyncio.wait_for(client.close(), ATTEMPT_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a client that never connected
                pass
        outcome[way] = "; ".join(got)
    return outcome


def large_body(http_port: int, size: int = 21 * 1024 * 1024) -> tuple[int, bytes]:
    """POST a 21 MB /v1/completions body; returns (status, the start of the answer)."""
    import http.client

    filler = b"word " * (size // 5)
    body = b'{"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "prompt": "' + filler + b'"}'
    conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=60)
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()
        try:
            conn.send(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before taking the rest: as it should
        response = conn.getresponse()
        return response.status, response.read(300)
    finally:
        conn.close()


def idle_connections(http_port: int, count: int, wait_s: float) -> int:
    """Open `count` connections that never send a byte; how many are still open after wait_s."""
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", http_port), timeout=5)
        s.setblocking(False)
        socks.append(s)
    deadline = time.monotonic() + wait_s
    open_ = set(range(count))
    while open_ and time.monotonic() < deadline:
        for i in list(open_):
            try:
                if socks[i].recv(1) == b"":
                    open_.discard(i)
            except BlockingIOError:
                pass
            except OSError:
                open_.discard(i)
        time.sleep(0.1)
    for s in socks:
        s.close()
    return len(open_)
