"""Workers that misbehave: a wrong secret, an impossible capacity, answers with the wrong
handles or token counts. Each is refused or dropped with a sentence; requests move on."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest

from common.client import SplitserveClient
from common.pb import worker_link_pb2 as pb
from common.pb import worker_link_pb2_grpc as pb_grpc
from tests.e2e.procs import Cluster

pytestmark = [pytest.mark.e2e]


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    c.start_scheduler("--worker-secret", "s3cret", "--worker-timeout", "3", "--max-migrations", "5")
    yield c
    c.stop_all()


def register(**overrides) -> pb.WorkerMessage:
    fields = dict(
        worker_id="rogue",
        model="SmolLM2-135M-Instruct",
        block_size=16,
        num_device_blocks=64,
        num_host_blocks=0,
        max_model_len=2048,
        vocab_size=49152,
        eos_token_id=2,
        secret="s3cret",
    )
    fields.update(overrides)
    return pb.WorkerMessage(register=pb.Register(**fields))


def connect(cluster, first: pb.WorkerMessage):
    channel = grpc.insecure_channel(f"127.0.0.1:{cluster.worker_port}")
    outbox: queue.Queue = queue.Queue()
    outbox.put(first)

    def messages():
        while (msg := outbox.get()) is not None:
            yield msg

    return channel, outbox, pb_grpc.WorkerLinkStub(channel).Connect(messages())


@pytest.mark.parametrize(
    "overrides,code,needle",
    [
        (dict(secret="wrong"), grpc.StatusCode.UNAUTHENTICATED, "secret"),
        (dict(num_device_blocks=0), grpc.StatusCode.INVALID_ARGUMENT, "no KV cache blocks"),
        (dict(block_size=0), grpc.StatusCode.INVALID_ARGUMENT, "block size"),
        (dict(num_device_blocks=10**9), grpc.StatusCode.INVALID_ARGUMENT, "impossible"),
        (dict(max_model_len=1), grpc.StatusCode.INVALID_ARGUMENT, "max_model_len"),
        (dict(model="other-model"), grpc.StatusCode.INVALID_ARGUMENT, "serves model"),
    ],
)
def test_bad_registration_is_refused(cluster, overrides, code, needle):
    channel, outbox, call = connect(cluster, register(**overrides))
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    assert err.value.code() == code and needle in err.value.details()
    outbox.put(None)
    channel.close()
    with SplitserveClient(cluster.target, timeout=10) as client:
        assert not client.server_info().workers


def test_first_message_must_be_register(cluster):
    channel, outbox, call = connect(cluster, pb.WorkerMessage(heartbeat=pb.Heartbeat(time=1)))
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    outbox.put(None)
    channel.close()


def bad_answer(step: pb.Step, kind: str) -> pb.StepResult:
    result = pb.StepResult(step_id=step.step_id)
    handles = [r.handle for r in step.new_requests] + [r.handle for r in step.cached_requests]
    for h in handles:
        if kind == "wrong_handle":
            result.sampled.add(handle=h + 1000, token_ids=[5])
        elif kind == "too_many_tokens":
            result.sampled.add(handle=h, token_ids=[5, 6, 7])
        elif kind == "outside_vocab":
            result.sampled.add(handle=h, token_ids=[10**6])
    if kind == "wrong_step_id":
        result.step_id = step.step_id + 7
    return result


@pytest.mark.parametrize(
    "kind", ["wrong_handle", "too_many_tokens", "outside_vocab", "missing_request", "wrong_step_id"]
)
def test_worker_answering_nonsense_is_dropped_and_request_finishes_elsewhere(cluster, kind):
    channel, outbox, call = connect(cluster, register(worker_id=f"rogue-{kind}"))
    assert next(call).WhichOneof("msg") == "register_ack"
    with SplitserveClient(cluster.target, timeout=60) as client:
        result: dict = {}
        t = threading.Thread(
            target=lambda: result.update(
                r=client.generate(
                    token_ids=[7, 8, 9], max_tokens=3, ignore_eos=True, temperature=0.0
                )
            )
        )
        t.start()
        msg = next(call)
        assert msg.WhichOneof("msg") == "step"
        outbox.put(pb.WorkerMessage(step_result=bad_answer(msg.step, kind)))
        # the scheduler ends the rogue's stream
        with pytest.raises((grpc.RpcError, StopIteration)):
            while True:
                next(call)
        outbox.put(None)
        channel.close()
        # a good worker joins; the request finishes there
        cluster.start_worker("good", "--simulate", "--worker-secret", "s3cret")
        t.join(60)
        assert result["r"].finish_reason == "length" and len(result["r"].token_ids) == 3
        assert result["r"].worker_ids[-1] == "good"
        deadline = time.monotonic() + 10
        while [w.worker_id for w in client.server_info().workers] != ["good"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert (
        "answered" in cluster.scheduler.log() or "unexpected step result" in cluster.scheduler.log()
    )
