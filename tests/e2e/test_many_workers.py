"""Many workers as real processes: join, leave, die, freeze; placement by prefix.

Workers here run the simulated model (--simulate: deterministic tokens, modelled step time,
no weights) so the mechanics are tested quickly and exactly; test_worker_loss_real_model.py
repeats the essential case with SmolLM2.
"""

from __future__ import annotations

import random
import signal
import threading
import time

import grpc
import pytest

from common.client import SplitserveClient
from tests.e2e.procs import Cluster
from worker_svc.sim_runner import sim_next_token

pytestmark = [pytest.mark.e2e]

VOCAB = 49152
SIM = (
    "--simulate",
    "--sim-step-base-ms",
    "15",
    "--sim-num-blocks",
    "2048",
    "--heartbeat-interval",
    "0.3",
)
SCHED = (
    "--max-num-seqs",
    "16",
    "--worker-queue-depth",
    "4",
    "--max-num-batched-tokens",
    "512",
    "--worker-timeout",
    "2",
    "--worker-wait-timeout",
    "20",
    "--max-migrations",
    "5",
)


def expected(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(sim_next_token(seq, VOCAB))
    return seq[len(prompt) :]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(8, 80))] for _ in range(n)]


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    c.start_scheduler(*SCHED)
    yield c
    c.stop_all()


def start_sim(c: Cluster, wid: str, *extra: str):
    return c.start_worker(wid, *SIM, *extra)


class Streams:
    """Runs requests in threads, recording every streamed token and the workers that served."""

    def __init__(self, client: SplitserveClient, plist: list[list[int]], max_tokens: int):
        self.client, self.plist, self.max_tokens = client, plist, max_tokens
        self.tokens: dict[int, list[int]] = {i: [] for i in range(len(plist))}
        self.finish: dict[int, str] = {}
        self.workers: dict[int, set[str]] = {i: set() for i in range(len(plist))}
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._one, args=(i,)) for i in range(len(plist))]

    def _one(self, i: int) -> None:
        try:
            for msg in self.client.stream(
                token_ids=self.plist[i],
                max_tokens=self.max_tokens,
                temperature=0.0,
                ignore_eos=True,
            ):
                self.tokens[i].extend(msg.token_ids)
                if msg.worker_id:
                    self.workers[i].add(msg.worker_id)
                if msg.finish_reason:
                    self.finish[i] = msg.finish_reason
        except BaseException as exc:  # noqa: BLE001
            self.errors.append(exc)

    def start(self) -> Streams:
        for t in self.threads:
            t.start()
        return self

    def progress(self) -> int:
        return sum(len(t) for t in self.tokens.values())

    def wait_progress(self, fraction: float, timeout: float = 60) -> None:
        total = self.max_tokens * len(self.plist)
        deadline = time.monotonic() + timeout
        while self.progress() < fraction * total:
            assert time.monotonic() < deadline, "requests made no progress"
            time.sleep(0.02)

    def join(self, timeout: float = 120) -> None:
        for t in self.threads:
            t.join(timeout)
        assert not self.errors, self.errors[:3]

    def check(self) -> None:
        for i, p in enumerate(self.plist):
            assert self.finish.get(i) == 2, f"request {i} ended with {self.finish.get(i)}"
            assert self.tokens[i] == expected(p, self.max_tokens), f"request {i} differs"


def workers(client) -> dict[str, object]:
    return {w.worker_id: w for w in client.server_info().workers}


def wait_workers(client, n: int, timeout: float = 60) -> None:
    """Until the server reports n workers; a front-end apart answers UNAVAILABLE until it has
    reached the leader, which counts as none yet."""
    deadline = time.monotonic() + timeout
    seen: dict[str, object] = {}
    while len(seen) != n:
        assert time.monotonic() < deadline, f"expected {n} workers, have {list(seen)}"
        time.sleep(0.05)
        try:
            seen = workers(client)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            seen = {}


def test_scale_from_one_to_three_while_streaming(cluster):
    start_sim(cluster, "s0", "--sim-step-base-ms", "30")
    with SplitserveClient(cluster.target, timeout=120) as client:
        wait_workers(client, 1)
        # more than one worker holds (16 running + 4 queued), so a backlog waits globally
        runs = Streams(client, prompts(160, seed=1), 40).start()
        runs.wait_progress(0.1)
        start_sim(cluster, "s1", "--sim-step-base-ms", "30")
        start_sim(cluster, "s2", "--sim-step-base-ms", "30")
        wait_workers(client, 3)
        runs.join()
        runs.check()
        served = {w for ws in runs.workers.values() for w in ws}
        # the workers that joined mid-run took work from the global queue
        assert served == {"s0", "s1", "s2"}, served
        info = client.server_info()
        assert all(w.num_free_blocks == w.num_blocks for w in info.workers)


@pytest.mark.parametrize("victim", ["k0", "k1", "k2"])
def test_kill_9_each_worker_mid_generation_loses_nothing(cluster, victim):
    procs = {w: start_sim(cluster, w) for w in ("k0", "k1", "k2")}
    with SplitserveClient(cluster.target, timeout=120) as client:
        wait_workers(client, 3)
        runs = Streams(client, prompts(24, seed=2), 48).start()
        runs.wait_progress(0.3)
        procs[victim].signal(signal.SIGKILL)
        runs.join()
        runs.check()  # same tokens as a run without failure, each exactly once
        assert any(victim in ws and len(ws) > 1 for ws in runs.workers.values()), (
            "some request should have moved off the killed worker"
        )
        wait_workers(client, 2)


def test_stream_interval_through_a_worker_loss(tmp_path):
    """--stream-interval 3 over real gRPC (the scheduler on uvloop): the first token alone,
    then three per message, the same tokens as without the option across a kill -9."""
    c = Cluster(tmp_path)
    plist = prompts(12, seed=5)
    sizes: dict[int, list[int]] = {i: [] for i in range(len(plist))}
    tokens: dict[int, list[int]] = {i: [] for i in range(len(plist))}
    errors: list[BaseException] = []

    def one(client, i: int) -> None:
        try:
            for msg in client.stream(
                token_ids=plist[i], max_tokens=40, temperature=0.0, ignore_eos=True
            ):
                if msg.token_ids:
                    sizes[i].append(len(msg.token_ids))
                    tokens[i].extend(msg.token_ids)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    try:
        c.start_scheduler(*SCHED, "--stream-interval", "3")
        procs = {w: start_sim(c, w) for w in ("s0", "s1")}
        with SplitserveClient(c.target, timeout=120) as client:
            wait_workers(client, 2)
            threads = [threading.Thread(target=one, args=(client, i)) for i in range(len(plist))]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 60
            while sum(map(len, tokens.values())) < 0.3 * 40 * len(plist):
                assert time.monotonic() < deadline, "requests made no progress"
                time.sleep(0.02)
            procs["s0"].signal(signal.SIGKILL)
            for t in threads:
                t.join(120)
            wait_workers(client, 1)  # s0 is gone; its requests finished on s1
        assert not errors, errors[:3]
        for i, p in enumerate(plist):
            assert tokens[i] == expected(p, 40), f"request {i} differs"
            assert sizes[i][0] == 1 and max(sizes[i]) == 3, sizes[i]
            assert sizes[i].count(3) >= 10, sizes[i]
        assert '"event_loop": "uvloop"' in c.scheduler.log()
    finally:
        c.stop_all()


def test_frozen_worker_is_detected_and_its_requests_finish_elsewhere(cluster):
    frozen = start_sim(cluster, "f0")
    start_sim(cluster, "f1")
    with SplitserveClient(cluster.target, timeout=120) as client:
        wait_workers(client, 2)
        runs = Streams(client, prompts(16, seed=3), 40).start()
        runs.wait_progress(0.25)
        frozen.signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            wait_workers(client, 1, timeout=20)
            detected_after = time.monotonic() - stopped_at
            assert detected_after < 2 + 2.5, f"took {detected_after:.1f} s (timeout 2 s)"
            runs.join()
            runs.check()
        finally:
            frozen.signal(signal.SIGCONT)


def test_slow_worker_is_not_mistaken_for_dead(cluster):
    # each step takes 3 s, longer than the 2 s worker timeout; heartbeats keep it alive
    start_sim(cluster, "slow", "--sim-step-base-ms", "3000")
    with SplitserveClient(cluster.target, timeout=120) as client:
        wait_workers(client, 1)
        result = client.generate(
            token_ids=[5, 6, 7], max_tokens=2, temperature=0.0, ignore_eos=True
        )
        assert result.token_ids == expected([5, 6, 7], 2)
        assert list(workers(client)) == ["slow"]


def test_sigterm_drains_without_failing_a_request(cluster):
    leaving = start_sim(cluster, "d0", "--drain-timeout", "30")
    start_sim(cluster, "d1")
    with SplitserveClient(cluster.target, timeout=120) as client:
        wait_workers(client, 2)
        runs = Streams(client, prompts(24, seed=4), 40).start()
        runs.wait_progress(0.2)
        leaving.signal(signal.SIGTERM)
        assert leaving.popen.wait(60) == 0
        runs.join()
        runs.check()
        assert "drained" in leaving.log()
        wait_workers(client, 1)


def test_drain_deadline_hands_requests_back(cluster):
    leaving = start_sim(cluster, "e0", "--drain-timeout", "0.5", "--sim-step-base-ms", "60")
    start_sim(cluster, "e1")
    with SplitserveClient(cluster.target, timeout=120) as client:
        wait_workers(client, 2)
        runs = Streams(client, prompts(12, seed=5), 60).start()
        runs.wait_progress(0.1)
        leaving.signal(signal.SIGTERM)
        assert leaving.popen.wait(60) == 0
        runs.join()
        runs.check()


def test_placement_sends_shared_prefix_to_the_same_worker(cluster):
    for w in ("p0", "p1", "p2"):
        start_sim(cluster, w)
    rng = random.Random(7)
    families = {name: [rng.randrange(3, VOCAB) for _ in range(96)] for name in ("A", "B")}
    with SplitserveClient(cluster.target, timeout=120) as client:
        wait_workers(client, 3)
        served: dict[str, set[str]] = {"A": set(), "B": set()}
        for _ in range(4):
            for name, prefix in families.items():
                suffix = [rng.randrange(3, VOCAB) for _ in range(8)]
                result = client.generate(
                    token_ids=prefix + suffix, max_tokens=4, temperature=0.0, ignore_eos=True
                )
                served[name].update(result.worker_ids)
        assert len(served["A"]) == 1 and len(served["B"]) == 1, served
    sched_log = cluster.scheduler.log()
    assert '"reason": "prefix"' in sched_log


def test_requests_wait_for_a_worker_then_run(cluster):
    with SplitserveClient(cluster.target, timeout=120) as client:
        runs = Streams(client, prompts(4, seed=6), 8).start()
        time.sleep(0.5)
        assert client.server_info().num_waiting == 4
        start_sim(cluster, "late")
        runs.join()
        runs.check()


def test_unavailable_when_the_only_worker_dies_and_none_returns(tmp_path):
    c = Cluster(tmp_path)
    try:
        c.start_scheduler("--worker-timeout", "2", "--worker-wait-timeout", "1")
        w = start_sim(c, "only", "--sim-step-base-ms", "50")
        with SplitserveClient(c.target, timeout=60) as client:
            wait_workers(client, 1)
            stream = client.stream(
                token_ids=[4, 5, 6], max_tokens=400, temperature=0.0, ignore_eos=True
            )
            next(stream)
            w.signal(signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as err:
                list(stream)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no worker" in err.value.details()
    finally:
        c.stop_all()
