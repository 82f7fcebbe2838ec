"""The worker's link across a scheduler failover: held rows reported by real id after a link
loss, fencing by epoch, switching to a new leader's address.

A scripted leader (an in-process gRPC server, one script per connection) drives a real
WorkerLinkClient over a simulated runner; the steps it sends come from a real core Scheduler.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest

from common.convert import HandleTable, decode_step_result, encode_step
from common.pb import worker_link_pb2 as pb
from common.pb import worker_link_pb2_grpc as pb_grpc
from scheduler_svc.core import Request, SamplingParams, Scheduler, SchedulerConfig
from worker_svc.link import WorkerLinkClient, WorkerLinkConfig
from worker_svc.sim_runner import SimConfig, SimRunner

TIMEOUT_S = 10.0


class ScriptedLeader(pb_grpc.WorkerLinkServicer):
    """Runs scripts[i](leader, reqs) for the i-th connection; each yields what to send, and
    the stream ends when it returns. Once the scripts are used up, a connection is answered
    by nothing until the worker leaves."""

    def __init__(self, *scripts) -> None:
        self.scripts = list(scripts)
        self.registers: list[pb.Register] = []
        self.received: list[str] = []  # kinds of what the worker sent after a fenced message
        self.changed = threading.Condition()
        self.expected: dict[str, tuple[list[int], int, int]] = {}

    def Connect(self, request_iterator, context):  # noqa: N802
        reqs = iter(request_iterator)
        register = next(reqs).register
        with self.changed:
            self.registers.append(register)
            index = len(self.registers) - 1
            self.changed.notify_all()
        script = self.scripts[index] if index < len(self.scripts) else _idle
        yield from script(self, reqs)

    def record_rest(self, reqs) -> None:
        """What the worker still sends until it closes its end of the stream."""
        self.received += [msg.WhichOneof("msg") for msg in _rest(reqs)]

    def wait_registers(self, n: int) -> list[pb.Register]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.registers) >= n, TIMEOUT_S)
            return list(self.registers)


def _rest(reqs):
    try:
        yield from reqs
    except Exception:  # noqa: BLE001 - the worker cancelled: its end is closed
        return


def _idle(leader, reqs):
    for _ in _rest(reqs):
        pass
    return
    yield


def ack(epoch: int) -> pb.SchedulerMessage:
    return pb.SchedulerMessage(register_ack=pb.RegisterAck(worker_id="w", epoch=epoch))


def step_result(reqs) -> pb.StepResult:
    for msg in reqs:
        if msg.WhichOneof("msg") == "step_result":
            return msg.step_result
    raise AssertionError("the worker closed its stream instead of answering a step")


@pytest.fixture
def serve():
    servers = []

    def start(leader: ScriptedLeader) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_WorkerLinkServicer_to_server(leader, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0)


@pytest.fixture
def worker():
    clients = []

    def start(address: str, **cfg) -> WorkerLinkClient:
        config = WorkerLinkConfig(
            scheduler=address, measure_costs=False, tune_gc=False, heartbeat_interval=60.0, **cfg
        )
        sim = SimConfig(sim_step_base_ms=0.0, sim_step_per_token_us=0.0, sim_num_blocks=64)
        client = WorkerLinkClient(config, SimRunner(sim, block_size=4, max_model_len=256))
        thread = threading.Thread(target=client.run_forever, daemon=True)
        thread.start()
        clients.append((client, thread))
        return client

    yield start
    for client, thread in clients:
        client.stop()
        thread.join(TIMEOUT_S)
        assert not thread.is_alive()


def run_three_requests(leader: ScriptedLeader, reqs):
    """Ack with epoch 5, run four steps of a real scheduler, then end the stream."""
    yield ack(5)
    cfg = SchedulerConfig(
        block_size=4, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256
    )
    sched, handles = Scheduler(cfg), HandleTable()
    for rid, n, max_tokens in (("req-a", 6, 50), ("req-b", 9, 50), ("req-c", 3, 1)):
        sched.add_request(
            Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens))
        )
    for _ in range(4):  # req-c finishes in the first; the second tells the worker
        out = sched.schedule()
        yield pb.SchedulerMessage(step=encode_step(out, handles, epoch=5))
        sampled, _ = decode_step_result(step_result(reqs), handles)
        sched.update_from_output(out, sampled)
    leader.expected = {
        r.request_id: (sched.kv.block_ids(r.request_id), r.num_computed_tokens, r.num_tokens)
        for r in sched.running
    }


def test_after_a_link_loss_the_next_register_reports_the_held_rows_by_request_id(serve, worker):
    leader = ScriptedLeader(run_three_requests)
    worker(serve(leader))
    first, second = leader.wait_registers(2)
    assert first.epoch == 0 and not first.held
    assert second.epoch == 5
    held = {
        h.request_id: (list(h.block_ids), h.num_computed_tokens, h.num_tokens) for h in second.held
    }
    assert set(held) == {"req-a", "req-b"}  # req-c finished
    assert held == leader.expected
    assert held["req-a"] == (held["req-a"][0], 9, 10) and len(held["req-a"][0]) == 3


def test_held_rows_are_reported_again_until_a_leader_runs_a_step(serve, worker):
    def ack_then_leave(leader, reqs):
        yield ack(6)

    leader = ScriptedLeader(run_three_requests, ack_then_leave)
    worker(serve(leader))
    _, second, third = leader.wait_registers(3)
    assert [h.request_id for h in third.held] == [h.request_id for h in second.held]
    assert third.epoch == 6


def test_a_step_from_an_older_epoch_is_refused_and_the_link_closed(serve, worker):
    def fenced_step(leader, reqs):
        yield ack(5)
        yield pb.SchedulerMessage(step=pb.Step(step_id=0, epoch=4))
        leader.record_rest(reqs)  # returns once the worker has closed the link

    leader = ScriptedLeader(fenced_step)
    client = worker(serve(leader))
    _, again = leader.wait_registers(2)
    assert again.epoch == 5 and client.epoch == 5
    assert "step_result" not in leader.received  # the fenced step was not executed
    assert client.num_steps == 0


def test_a_register_ack_from_an_older_epoch_is_refused(serve, worker):
    def ack_then_leave(epoch):
        def script(leader, reqs):
            yield ack(epoch)

        return script

    def stale(leader, reqs):
        yield ack(3)
        yield pb.SchedulerMessage(step=pb.Step(step_id=0, epoch=3))
        leader.record_rest(reqs)

    leader = ScriptedLeader(ack_then_leave(5), stale)
    client = worker(serve(leader))
    registers = leader.wait_registers(3)
    assert [r.epoch for r in registers] == [0, 5, 5]
    assert "step_result" not in leader.received and client.epoch == 5


def test_switch_scheduler_closes_the_link_and_dials_the_new_address_at_once(serve, worker):
    def ack_and_hold(leader, reqs):
        yield ack(1)
        leader.record_rest(reqs)

    old, new = ScriptedLeader(ack_and_hold), ScriptedLeader()
    client = worker(serve(old))
    old.wait_registers(1)
    deadline = time.monotonic() + TIMEOUT_S
    while not client._attached and time.monotonic() < deadline:
        time.sleep(0.01)
    client.switch_scheduler(serve(new))
    started = time.monotonic()
    [register] = new.wait_registers(1)
    assert time.monotonic() - started < 1.0 and register.epoch == 1
    assert len(old.registers) == 1  # the old link is closed, not dialled again


def test_switch_scheduler_cuts_a_long_reconnect_wait_short(serve, worker):
    client = worker("127.0.0.1:1", reconnect_max_backoff=60.0)  # nothing listens there
    sessions = 0
    run_session = client._run_session

    def counted():
        nonlocal sessions
        attached = run_session()
        sessions += 1
        return attached

    client._run_session = counted
    deadline = time.monotonic() + TIMEOUT_S
    while sessions < 4 and time.monotonic() < deadline:  # the 4th failed: a wait of >= 1.5 s
        time.sleep(0.01)
    new = ScriptedLeader()
    client.switch_scheduler(serve(new))
    started = time.monotonic()
    new.wait_registers(1)
    assert time.monotonic() - started < 1.0


class FakeWatcher:
    """common.leader_watcher.LeaderWatcherThread as the link uses it (etcd not needed)."""

    instances: list[FakeWatcher] = []

    def __init__(self, endpoint, on_change, credentials=None) -> None:
        self.endpoint, self.on_change = endpoint, on_change
        self.current = None
        self.stopped = False
        FakeWatcher.instances.append(self)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        self.stopped = True

    def wait_for_leader(self, timeout):
        time.sleep(0.01)
        return self.current

    def elect(self, epoch: int, address: str) -> None:
        self.current = SimpleNamespace(epoch=epoch, info={"worker_address": address})
        self.on_change(self.current)


def test_with_etcd_the_worker_waits_for_a_leader_and_follows_each_new_one(
    serve, worker, monkeypatch
):
    monkeypatch.setitem(
        sys.modules, "common.leader_watcher", SimpleNamespace(LeaderWatcherThread=FakeWatcher)
    )
    FakeWatcher.instances.clear()
    first, second = ScriptedLeader(lambda leader, reqs: iter([ack(4)])), ScriptedLeader()
    client = worker("127.0.0.1:1", etcd="etcd:2379")  # --scheduler is not dialled
    deadline = time.monotonic() + TIMEOUT_S
    while not FakeWatcher.instances and time.monotonic() < deadline:
        time.sleep(0.01)
    [watcher] = FakeWatcher.instances
    assert watcher.endpoint == "etcd:2379"
    time.sleep(0.1)
    assert client._call is None  # no leader yet: nothing dialled
    watcher.elect(4, serve(first))
    first.wait_registers(1)
    while client.epoch != 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    followed = client.cfg.scheduler
    watcher.elect(3, serve(second))  # older than the epoch accepted: not followed
    assert client.cfg.scheduler == followed
    watcher.elect(9, serve(second))
    [register] = second.wait_registers(1)
    assert register.epoch == 4 and client.cfg.scheduler == watcher.current.info["worker_address"]
    client.stop()
    deadline = time.monotonic() + TIMEOUT_S
    while not watcher.stopped and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watcher.stopped


def test_the_sim_runner_holds_its_rows_not_the_preempted_ones():
    from common.messages import NewRequestData, SchedulerOutput

    runner = SimRunner(SimConfig(sim_step_base_ms=0.0, sim_step_per_token_us=0.0))
    params = SamplingParams(max_tokens=8)
    out = SchedulerOutput(
        new_requests=[
            NewRequestData("1", [1, 2, 3], params, [4], 0),
            NewRequestData("2", [5, 6], params, [7], 0),
        ],
        num_scheduled_tokens={"1": 3, "2": 2},
        total_num_scheduled_tokens=5,
    )
    runner.execute_model(out)
    assert sorted(runner.held_requests()) == [("1", [4], 3, 4), ("2", [7], 2, 3)]
    runner.execute_model(SchedulerOutput(preempted_req_ids={"2"}, step_id=1))
    assert runner.held_requests() == [("1", [4], 3, 4)]
    runner.reset()
    assert runner.held_requests() == []
