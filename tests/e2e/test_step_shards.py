"""Step shards as real processes: a leader with the global queue, shards that run the step
loops of the workers dialing them, a front-end apart (docs/architecture.md, "Step shards").

Workers run the simulated model, whose greedy tokens are known exactly (sim_next_token): every
stream is compared token by token with what one undisturbed worker gives.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from common.client import SplitserveClient
from tests.e2e.procs import Cluster, Proc, free_port, wait_for_port
from tests.e2e.test_many_workers import SCHED, SIM, VOCAB, Streams, prompts, wait_workers

pytestmark = [pytest.mark.e2e]


@dataclass
class ShardedCluster:
    """A leader (no client API), N shards with one simulated worker each, one front-end."""

    base: Cluster
    shards: list[Proc] = field(default_factory=list)
    shard_ports: list[int] = field(default_factory=list)
    frontend_port: int = field(default_factory=free_port)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.frontend_port}"

    def start(self, num_shards: int, *sched: str, worker_args: tuple = SIM) -> None:
        c = self.base
        c.scheduler = c._spawn(
            "leader",
            [
                "scheduler",
                "--no-client-api",
                "--host",
                "127.0.0.1",
                "--http-port",
                "0",
                "--worker-port",
                str(c.worker_port),
                *SCHED,
                *sched,
            ],
        )
        wait_for_port(c.worker_port, c.scheduler)
        self.shard_ports = [free_port() for _ in range(num_shards)]
        for i, port in enumerate(self.shard_ports):
            shard = c._spawn(
                f"shard-{i}",
                [
                    "shard",
                    "--host",
                    "127.0.0.1",
                    "--worker-port",
                    str(port),
                    "--leader",
                    f"127.0.0.1:{c.worker_port}",
                    "--scheduler-id",
                    f"shard-{i}",
                    *SCHED,
                    *sched,
                ],
            )
            self.shards.append(shard)
            wait_for_port(port, shard)
        for i, port in enumerate(self.shard_ports):
            # its own shard first, the others for when that one is lost (it takes its rows)
            others = [p for p in self.shard_ports if p != port]
            dial = ",".join(f"127.0.0.1:{p}" for p in [port, *others])
            c._spawn(f"w{i}", ["worker", "--scheduler", dial, "--worker-id", f"w{i}", *worker_args])
        frontend = c._spawn(
            "frontend",
            [
                "frontend",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.frontend_port),
                "--http-port",
                "0",
                "--scheduler",
                f"127.0.0.1:{c.worker_port}",
                "--frontend-id",
                "fe0",
            ],
        )
        wait_for_port(self.frontend_port, frontend)

    def leader_events(self, event: str) -> list[dict]:
        assert self.base.scheduler is not None
        return _events(self.base.scheduler.log_path, event)


def _events(path: Path, event: str) -> list[dict]:
    found = []
    for line in path.read_text(errors="replace").splitlines():
        if f'"{event}"' in line and line.startswith("{"):
            found.append(json.loads(line))
    return found


@pytest.fixture
def sharded(tmp_path):
    cluster = ShardedCluster(Cluster(tmp_path))
    yield cluster
    cluster.base.stop_all()


def test_streams_over_two_shards_are_exact(sharded):
    sharded.start(2)
    with SplitserveClient(sharded.target, timeout=120) as client:
        wait_workers(client, 2)
        runs = Streams(client, prompts(24, seed=11), 40).start()
        runs.join()
        runs.check()
        served = set().union(*runs.workers.values())
        assert served == {"w0", "w1"}, served  # both shards' workers ran requests
        info = client.server_info()
        assert {w.address for w in info.workers} == {"shard shard-0", "shard shard-1"}
    placed = sharded.leader_events("request_placed")
    assert len(placed) == 24
    assert {p["worker_id"] for p in placed} == {"w0", "w1"}


def test_placement_follows_the_prefix_across_shards(sharded):
    sharded.start(2)
    rng = random.Random(7)
    families = {name: [rng.randrange(3, VOCAB) for _ in range(96)] for name in ("A", "B")}
    with SplitserveClient(sharded.target, timeout=120) as client:
        wait_workers(client, 2)
        served: dict[str, set[str]] = {"A": set(), "B": set()}
        for _ in range(4):
            for name, prefix in families.items():
                suffix = [rng.randrange(3, VOCAB) for _ in range(8)]
                result = client.generate(
                    token_ids=prefix + suffix, max_tokens=4, temperature=0.0, ignore_eos=True
                )
                served[name].update(result.worker_ids)
        # each family stays where its prefix is cached, as its shard reported it
        assert len(served["A"]) == 1 and len(served["B"]) == 1, served
    reasons = [p["reason"] for p in sharded.leader_events("request_placed")]
    assert reasons.count("prefix") >= 6, reasons


def test_a_shard_killed_under_load_loses_no_token_and_its_worker_keeps_its_rows(sharded):
    sharded.start(2)
    with SplitserveClient(sharded.target, timeout=120) as client:
        wait_workers(client, 2)
        runs = Streams(client, prompts(64, seed=12), 40).start()
        runs.wait_progress(0.3)
        sharded.shards[0].signal(signal.SIGKILL)
        runs.join()
        runs.check()  # every stream equal to the undisturbed run, finished by length
        wait_workers(client, 2)  # w0 is back, attached to shard-1
    lost = sharded.leader_events("shard_lost")
    assert lost and lost[0]["shard_id"] == "shard-0" and lost[0]["reclaimed"] > 0, lost
    # w0 took its rows to shard-1, and the requests they hold went on on them: placed back on
    # w0 ("held") and adopted there, nothing computed again
    again = [p for p in sharded.leader_events("request_placed") if p["migrations"] > 0]
    held = [p for p in again if p["reason"] == "held"]
    assert held and {p["worker_id"] for p in held} == {"w0"}, again
    adopted = _events(sharded.base.procs[2].log_path, "request_adopted")  # shard-1's log
    refused = _events(sharded.base.procs[2].log_path, "adopt_refused")
    assert {a["request_id"] for a in adopted} == {p["request_id"] for p in held}, refused


def test_a_higher_priority_request_goes_ahead_of_lower_ones_waiting_on_any_shard(sharded):
    # 1 seat and a local queue of 2 per worker: 6 long low-priority requests fill every seat
    # and every local queue. The high-priority one that comes next must start with the first
    # of those waiting (within a step or two), not after them: held in the leader's queue until
    # a local queue had room, it would start only once a whole low request had run
    sharded.start(
        2,
        "--scheduling-policy",
        "priority",
        "--max-num-seqs",
        "1",
        "--worker-queue-depth",
        "2",
    )
    tokens: dict[str, int] = {}
    when_high_started: dict[str, int] = {}
    lock = threading.Lock()

    def run(client, name: str, prompt: list[int], priority: int, max_tokens: int) -> None:
        for msg in client.stream(
            token_ids=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            priority=priority,
        ):
            with lock:
                tokens[name] = tokens.get(name, 0) + len(msg.token_ids)
                if name == "high" and not when_high_started:
                    when_high_started.update(tokens)

    plist = prompts(7, seed=13)
    with SplitserveClient(sharded.target, timeout=120) as client:
        wait_workers(client, 2)
        low = [
            threading.Thread(target=run, args=(client, f"low{i}", plist[i], 5, 60))
            for i in range(6)
        ]
        for t in low:
            t.start()
        deadline = time.monotonic() + 30
        while len(tokens) < 2:  # every seat busy, the local queues full
            assert time.monotonic() < deadline, tokens
            time.sleep(0.01)
        with lock:
            started = set(tokens)
        high = threading.Thread(target=run, args=(client, "high", plist[6], 0, 4))
        high.start()
        for t in [*low, high]:
            t.join(60)
    assert tokens["high"] == 4 and all(tokens[f"low{i}"] == 60 for i in range(6)), tokens
    waiting_then = [f"low{i}" for i in range(6) if f"low{i}" not in started]
    assert len(waiting_then) == 4, started
    # tokens each of those had when the high one got its first: a step or two's worth at most
    behind = {name: when_high_started.get(name, 0) for name in waiting_then}
    assert max(behind.values()) <= 3, (behind, when_high_started)


def test_fair_share_holds_across_shards(sharded):
    # two tenants weighted 3:1, both backlogged on two shards' workers, their requests sent
    # alternately: while both have work the tokens go 3:1, not 1:1 as arrival order would have
    # them (the leader charges each request as it places it; what it computed settles it)
    sharded.start(
        2,
        "--scheduling-policy",
        "fair",
        "--tenants",
        "a:3,b:1",
        "--max-num-seqs",
        "2",
        "--worker-queue-depth",
        "1",
    )
    per_tenant = {"a": 0, "b": 0}
    at_half: dict[str, int] = {}
    lock = threading.Lock()
    num_each, max_tokens = 24, 20
    half = num_each * max_tokens  # of both tenants' tokens

    def run(client, tenant: str, prompt: list[int]) -> None:
        for msg in client.stream(
            token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, tenant=tenant
        ):
            with lock:
                per_tenant[tenant] += len(msg.token_ids)
                if not at_half and sum(per_tenant.values()) >= half:
                    at_half.update(per_tenant)

    plist = prompts(2 * num_each, seed=14)
    with SplitserveClient(sharded.target, timeout=120) as client:
        wait_workers(client, 2)
        threads = [
            threading.Thread(target=run, args=(client, "ab"[i % 2], plist[i]))
            for i in range(2 * num_each)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert per_tenant == {"a": num_each * max_tokens, "b": num_each * max_tokens}, per_tenant
    share_a = at_half["a"] / (at_half["a"] + at_half["b"])
    assert abs(share_a - 0.75) <= 0.075, at_half  # within 10 % of the weights
