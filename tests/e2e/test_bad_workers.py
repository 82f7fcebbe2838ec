"""Workers that misbehave: an impossible capacity or vocabulary, answers with the wrong handles,
token counts or token ids. Each is refused or dropped with a sentence; requests move on, and a
healthy worker beside a bad one is never dropped for it (issue #35).

Run as a script (`python -m tests.e2e.test_bad_workers PORT BAD_ID`), this module is the rogue
worker process of the last test: it registers as the scheduler expects (plaintext on loopback)
and answers its first step with BAD_ID for one request."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time

import grpc
import pytest

from common.client import SplitserveClient
from common.pb import worker_link_pb2 as pb
from common.pb import worker_link_pb2_grpc as pb_grpc
from tests.e2e.conftest import SCHEDULER_FLAGS, WORKER_FLAGS
from tests.e2e.procs import ROOT, Cluster

pytestmark = [pytest.mark.e2e]

VOCAB = 49152  # SmolLM2-135M-Instruct, the default model


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    c.start_scheduler("--worker-timeout", "3", "--max-migrations", "5")
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
        vocab_size=VOCAB,
        eos_token_id=2,
    )
    fields.update(overrides)
    return pb.WorkerMessage(register=pb.Register(**fields))


def connect(worker_port: int, first: pb.WorkerMessage):
    channel = grpc.insecure_channel(f"127.0.0.1:{worker_port}")
    outbox: queue.Queue = queue.Queue()
    outbox.put(first)

    def messages():
        while (msg := outbox.get()) is not None:
            yield msg

    return channel, outbox, pb_grpc.WorkerLinkStub(channel).Connect(messages())


@pytest.mark.parametrize(
    "overrides,code,needle",
    [
        (dict(num_device_blocks=0), grpc.StatusCode.INVALID_ARGUMENT, "no KV cache blocks"),
        (dict(block_size=0), grpc.StatusCode.INVALID_ARGUMENT, "block size"),
        (dict(num_device_blocks=10**9), grpc.StatusCode.INVALID_ARGUMENT, "impossible"),
        (dict(max_model_len=1), grpc.StatusCode.INVALID_ARGUMENT, "max_model_len"),
        (dict(model="other-model"), grpc.StatusCode.INVALID_ARGUMENT, "serves model"),
        (dict(vocab_size=0), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary of 0 tokens"),
        (dict(vocab_size=VOCAB + 1), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    ],
)
def test_bad_registration_is_refused(cluster, overrides, code, needle):
    channel, outbox, call = connect(cluster.worker_port, register(**overrides))
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    assert err.value.code() == code and needle in err.value.details()
    outbox.put(None)
    channel.close()
    with SplitserveClient(cluster.target, timeout=10) as client:
        assert not client.server_info().workers


def test_first_message_must_be_register(cluster):
    channel, outbox, call = connect(
        cluster.worker_port, pb.WorkerMessage(heartbeat=pb.Heartbeat(time=1))
    )
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    outbox.put(None)
    channel.close()


def scheduled_handles(step: pb.Step) -> list[int]:
    handles = [r.handle for r in step.new_requests if r.num_scheduled_tokens]
    handles += [r.handle for r in step.cached_requests if r.num_scheduled_tokens]
    running = step.running
    handles += [h for h, n in zip(running.handles, running.num_scheduled_tokens, strict=True) if n]
    return handles


def bad_answer(step: pb.Step, kind: str) -> pb.StepResult:
    result = pb.StepResult(step_id=step.step_id)
    for h in scheduled_handles(step):
        if kind == "wrong_handle":
            result.sampled.add(handle=h + 1000, token_ids=[5])
        elif kind == "too_many_tokens":
            result.sampled.add(handle=h, token_ids=[5, 6, 7])
        elif kind == "outside_vocab":
            result.sampled.add(handle=h, token_ids=[VOCAB])
        elif kind == "top_logprob_outside_vocab":
            result.sampled.add(
                handle=h, token_ids=[5], logprobs=[-0.1], top_token_ids=[VOCAB], top_logprobs=[-1]
            )
    if kind == "wrong_step_id":
        result.step_id = step.step_id + 7
    return result


@pytest.mark.parametrize(
    "kind",
    [
        "wrong_handle",
        "too_many_tokens",
        "outside_vocab",
        "top_logprob_outside_vocab",
        "missing_request",
        "wrong_step_id",
    ],
)
def test_worker_answering_nonsense_is_dropped_and_request_finishes_elsewhere(cluster, kind):
    channel, outbox, call = connect(cluster.worker_port, register(worker_id=f"rogue-{kind}"))
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
        cluster.start_worker("good", "--simulate")
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


PROMPTS = [f"Write one sentence about {topic}." for topic in ("rivers", "bread", "chess", "trains")]
MAX_TOKENS = 16


def generate_all(client: SplitserveClient) -> list:
    """Every prompt at once (so placement spreads them over the workers), greedy."""
    results: list = [None] * len(PROMPTS)

    def one(i: int) -> None:
        results[i] = client.generate(
            PROMPTS[i], max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


def detaches(scheduler_log: str) -> list[dict]:
    events = []
    for line in scheduler_log.splitlines():
        if '"worker_detached"' in line:
            events.append(json.loads(line))
    return events


def test_an_impossible_token_drops_its_worker_and_never_the_honest_one(tmp_path):
    """The rogue registers right and answers its first step with an id past the vocabulary
    (its other answers are valid ids, just not the model's): the whole step is refused, the
    rogue cut off, its requests finish on the real worker with the text they would have had,
    and the real worker, which would fail a step on such an id, is never detached."""
    cluster = Cluster(tmp_path)
    try:
        cluster.start_scheduler(*SCHEDULER_FLAGS, "--log-json")
        cluster.start_worker("honest", *WORKER_FLAGS)
        with SplitserveClient(cluster.target, timeout=300) as client:
            client.wait_for_workers(1, timeout=240)
            rogue = subprocess.Popen(
                [sys.executable, "-m", "tests.e2e.test_bad_workers", str(cluster.worker_port)],
                cwd=ROOT,
            )
            try:
                client.wait_for_workers(2, timeout=60)
                moved = generate_all(client)
                assert rogue.wait(60) == 0  # its stream was ended by the scheduler
            finally:
                if rogue.poll() is None:
                    rogue.kill()
            reference = generate_all(client)  # the honest worker alone
            assert [w.worker_id for w in client.server_info().workers] == ["honest"]
        for got, want in zip(moved, reference, strict=True):
            assert got.finish_reason == want.finish_reason == "length"
            assert got.token_ids == want.token_ids and len(got.token_ids) == MAX_TOKENS
            assert got.text == want.text
        [detached] = detaches(cluster.scheduler.log())
        assert detached["worker_id"] == "rogue" and "vocabulary size" in detached["reason"]
        assert detached["migrated"] >= 1, "the rogue got no request"
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        cluster.stop_all()


def rogue_worker(worker_port: int, bad_id: int = 999_999_999) -> None:
    """The rogue process: registers right, heartbeats, answers its first step with `bad_id`
    for one request and a valid id for the others; exits once the scheduler ends its stream."""
    channel, outbox, call = connect(worker_port, register())
    stop = threading.Event()

    def heartbeats() -> None:
        while not stop.wait(0.5):
            outbox.put(pb.WorkerMessage(heartbeat=pb.Heartbeat(time=time.time())))

    threading.Thread(target=heartbeats, daemon=True).start()
    try:
        for msg in call:
            if msg.WhichOneof("msg") != "step" or not scheduled_handles(msg.step):
                continue
            result = pb.StepResult(step_id=msg.step.step_id)
            for i, handle in enumerate(scheduled_handles(msg.step)):
                result.sampled_handles.append(handle)
                result.sampled_token_ids.append(bad_id if i == 0 else 100 + i)
            outbox.put(pb.WorkerMessage(step_result=result))
    except grpc.RpcError:
        pass
    finally:
        stop.set()
        outbox.put(None)
        channel.close()


if __name__ == "__main__":
    rogue_worker(int(sys.argv[1]), *(int(a) for a in sys.argv[2:]))
