"""Step shards through a leader failover: two leader candidates elected in a local etcd, two
shards and a front-end that follow whoever etcd names leader (docs/architecture.md, "Step
shards"). The leader is killed (SIGKILL) under load: the shards drop what they run and dial the
new leader, the front-end resubmits its requests there with the tokens its clients have, and
the new leader places them again on both shards' workers. Every stream must carry exactly the
tokens of an undisturbed run (the simulated model's greedy tokens, sim_next_token).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from common.client import SplitserveClient
from common.etcd_server import EtcdServer
from tests.e2e.procs import Cluster, Proc, free_port, wait_for_port
from tests.e2e.test_many_workers import SCHED, SIM, Streams, prompts, wait_workers
from tests.e2e.test_step_shards import _events

pytestmark = [pytest.mark.e2e]

NUM_SCHEDULERS = 2
NUM_SHARDS = 2


@dataclass
class HAShardedCluster:
    """Leader candidates under etcd (no client API), shards and one front-end that follow the
    leader through etcd, one simulated worker per shard."""

    base: Cluster
    etcd: EtcdServer
    schedulers: list[Proc] = field(default_factory=list)
    scheduler_ports: list[int] = field(default_factory=list)
    shards: list[Proc] = field(default_factory=list)
    frontend: Proc | None = None
    frontend_port: int = field(default_factory=free_port)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.frontend_port}"

    def start(self) -> None:
        c, etcd = self.base, self.etcd.endpoint
        for i in range(NUM_SCHEDULERS):
            port = free_port()
            self.scheduler_ports.append(port)
            sched = c._spawn(
                f"scheduler-{i}",
                [
                    "scheduler",
                    "--no-client-api",
                    "--host",
                    "127.0.0.1",
                    "--http-port",
                    "0",
                    "--worker-port",
                    str(port),
                    "--etcd",
                    etcd,
                    "--scheduler-id",
                    f"scheduler-{i}",
                    *SCHED,
                ],
            )
            self.schedulers.append(sched)
            wait_for_port(port, sched)
        for i in range(NUM_SHARDS):
            port = free_port()
            shard = c._spawn(
                f"shard-{i}",
                [
                    "shard",
                    "--host",
                    "127.0.0.1",
                    "--worker-port",
                    str(port),
                    "--etcd",
                    etcd,
                    "--scheduler-id",
                    f"shard-{i}",
                    *SCHED,
                ],
            )
            self.shards.append(shard)
            wait_for_port(port, shard)
            c._spawn(
                f"w{i}",
                ["worker", "--scheduler", f"127.0.0.1:{port}", "--worker-id", f"w{i}", *SIM],
            )
        self.frontend = c._spawn(
            "frontend",
            [
                "frontend",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.frontend_port),
                "--http-port",
                "0",
                "--etcd",
                etcd,
                "--frontend-id",
                "fe0",
            ],
        )
        wait_for_port(self.frontend_port, self.frontend)

    def leader(self, timeout: float = 30.0, exclude: Proc | None = None) -> Proc:
        """The scheduler whose log says it leads (leader_ready), other than `exclude`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready = [
                s
                for s in self.schedulers
                if s is not exclude and s.alive() and _events(s.log_path, "leader_ready")
            ]
            if ready:
                assert len(ready) == 1, [s.name for s in ready]
                return ready[0]
            time.sleep(0.05)
        raise TimeoutError("no scheduler became leader\n" + self.base.logs())


@pytest.fixture
def ha_sharded(tmp_path) -> Iterator[HAShardedCluster]:
    etcd = EtcdServer(unsafe_no_fsync=True)
    etcd.start()
    cluster = HAShardedCluster(Cluster(tmp_path), etcd)
    try:
        yield cluster
    finally:
        cluster.base.stop_all()
        etcd.stop()


def test_leader_killed_under_load_shards_follow_the_new_leader(ha_sharded):
    c = ha_sharded
    c.start()
    old = c.leader()
    # streams take a few seconds here: a short deadline fails a stuck one quickly
    with SplitserveClient(c.target, timeout=30) as client:
        wait_workers(client, NUM_SHARDS)
        for shard in c.shards:  # each shard linked to the first leader
            assert len(_events(shard.log_path, "shard_linked")) == 1, shard.log()
        runs = Streams(client, prompts(24, seed=21), 60).start()
        runs.wait_progress(0.3)
        old.signal(signal.SIGKILL)
        try:
            runs.join(40)
            runs.check()  # every stream equal to the undisturbed run, finished by length
        except AssertionError:
            print(c.base.logs())
            raise
    new = c.leader(exclude=old)
    takeover = _events(new.log_path, "leader_ready")[-1]
    assert takeover["takeover"], takeover
    # the front-end resubmitted what it had in flight to the new leader (during its rebuild or
    # just after: the hello's answer counts them either way)
    assert c.frontend is not None
    connected = _events(c.frontend.log_path, "leader_connected")
    assert connected[-1]["resumed"] > 0, connected
    # the shards ran requests when the leader died, dropped them, and the new leader placed them
    assert any(_events(s.log_path, "shard_dropped_requests") for s in c.shards)
    # the new leader placed the resubmitted requests on both shards' workers
    placed = _events(new.log_path, "request_placed")
    assert {p["worker_id"] for p in placed} == {"w0", "w1"}, (placed, c.base.logs())
    new_address = f"127.0.0.1:{c.scheduler_ports[c.schedulers.index(new)]}"
    for shard in c.shards:
        linked = _events(shard.log_path, "shard_linked")
        assert len(linked) == 2, (shard.name, shard.log())
        assert linked[-1]["leader"] == new_address, linked
        assert linked[-1]["epoch"] > linked[0]["epoch"], linked
