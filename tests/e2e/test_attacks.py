"""Issue #35's attacks, through real processes: `splitserve up` as the quickstart runs it (one
worker, the real model, no flag about security) and `up --workers 2 --schedulers 2 --frontends 2`
with an API key. An outsider knows the ports and the .proto files (tests/e2e/attackers.py).
While it tries, honest clients stream greedy answers under request ids the attacker is given
(the worst case: it guessed them); each must get exactly the text of an undisturbed run, and no
honest worker may be detached."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from common.client import SplitserveClient
from common.credentials import create_cluster
from tests.e2e import attackers
from tests.e2e.procs import ROOT, free_port, interrupt

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

API_KEY = "attacks-e2e-key"
NUM_STREAMS = 8
MAX_TOKENS = 48
PROMPTS = [
    f"Customer {i} password is hunter{i}. Write one sentence about rivers." for i in range(8)
]
SYSTEMS = {
    "up": ("--workers", "1"),
    "ha": ("--workers", "2", "--schedulers", "2", "--frontends", "2", "--api-key", API_KEY),
}
COMMON = (
    *("--max-model-len", "1024", "--max-num-seqs", "32", "--max-num-batched-tokens", "256"),
    *("--worker-arg=--num-gpu-blocks=320", "--lease-ttl", "3", "--http-header-timeout", "2"),
)


@dataclass
class Stream:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    error: str = ""


@dataclass
class System:
    name: str
    popen: subprocess.Popen
    port: int
    http_port: int
    worker_port: int
    etcd_port: int
    state: Path
    log_path: Path
    api_key: str | None
    run: int = 0

    @property
    def rogue(self) -> Path:
        """The attacker's own CA and certificates (common/credentials.py, another cluster)."""
        return create_cluster(self.state.parent / "rogue")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str, key: str | None = None) -> tuple[int, dict | None]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.http_port}{path}")
        if key:
            request.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(request, timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, None
        except (urllib.error.URLError, OSError):
            return 0, None

    def cluster(self) -> dict | None:
        status, body = self.get("/cluster", self.api_key)
        return body if status == 200 else None

    def wait_ready(self, timeout: float = 300.0) -> dict:
        workers = 2 if self.name == "ha" else 1
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.popen.poll() is None, self.log()[-5000:]
            body = self.cluster()
            if body and sum(w["state"] == "active" for w in body["workers"]) == workers:
                if self.name != "ha" or len(body["frontends"]) == 2:
                    return body
            time.sleep(0.3)
        raise TimeoutError(self.log()[-8000:])

    def streams(self, disturb=None) -> list[Stream]:
        """NUM_STREAMS honest streams at once, each on its own connection; `disturb()` runs
        once they have all started. Request ids are known in advance: victim_ids()."""
        self.run += 1
        results = [Stream() for _ in range(NUM_STREAMS)]
        started = threading.Barrier(NUM_STREAMS + 1)

        def one(i: int) -> None:
            result = results[i]
            with SplitserveClient(
                f"127.0.0.1:{self.port}", api_key=self.api_key, timeout=300, own_connection=True
            ) as client:
                try:
                    stream = client.stream(
                        PROMPTS[i],
                        request_id=self.victim_ids()[i],
                        max_tokens=MAX_TOKENS,
                        temperature=0.0,
                        ignore_eos=True,
                    )
                    for k, msg in enumerate(stream):
                        if k == 0:
                            started.wait(60)
                        result.token_ids += msg.token_ids
                        result.text += msg.text
                except grpc.RpcError as exc:
                    result.error = f"{exc.code().name}: {exc.details()}"
                except threading.BrokenBarrierError:
                    result.error = "the streams did not all start"

        threads = [threading.Thread(target=one, args=(i,)) for i in range(NUM_STREAMS)]
        for t in threads:
            t.start()
        started.wait(120)
        if disturb is not None:
            disturb()
        for t in threads:
            t.join(300)
        return results

    def victim_ids(self) -> list[str]:
        return [f"victim-{self.run}-{i}" for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module", params=sorted(SYSTEMS))
def system(request, tmp_path_factory):
    name = request.param
    tmp = tmp_path_factory.mktemp(f"attacks-{name}")
    port, http_port, worker_port, etcd_port = (free_port() for _ in range(4))
    argv = [sys.executable, "-m", "splitserve.cli", "up", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--http-port", str(http_port)]
    argv += ["--worker-port", str(worker_port), "--etcd-port", str(etcd_port)]
    argv += [*SYSTEMS[name], *COMMON]
    log_path = tmp / "up.log"
    env = {"SPLITSERVE_STATE_DIR": str(tmp / "state"), "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
        )
    key = API_KEY if "--api-key" in SYSTEMS[name] else None
    sut = System(name, popen, port, http_port, worker_port, etcd_port, tmp / "state", log_path, key)
    try:
        sut.wait_ready()
        yield sut
    except BaseException:
        print(sut.log()[-20000:])
        raise
    finally:
        interrupt(popen)


@pytest.fixture(scope="module")
def baseline(system) -> list[Stream]:
    results = system.streams()
    assert all(not r.error and len(r.token_ids) == MAX_TOKENS for r in results), results
    return results


def assert_undisturbed(system: System, results: list[Stream], baseline: list[Stream]) -> None:
    for i, (got, want) in enumerate(zip(results, baseline, strict=True)):
        assert not got.error, f"stream {i}: {got.error}\n{system.log()[-6000:]}"
        assert got.token_ids == want.token_ids and got.text == want.text, f"stream {i} differs"
    detached = [line for line in system.log().splitlines() if '"worker_detached"' in line]
    assert detached == [], detached


def attack(coroutine_factory) -> tuple[dict, object]:
    """An attack to run on a loop of its own (as another process would): (box, go); go()
    runs it and puts its outcome in box["outcome"]."""
    box: dict = {}

    def go() -> None:
        box["outcome"] = asyncio.run(coroutine_factory())

    return box, go


def test_an_outsider_registers_no_worker_and_is_sent_no_prompt(system, baseline):
    box, go = attack(
        lambda: attackers.rogue_worker(
            f"127.0.0.1:{system.worker_port}",
            system.rogue / "worker",
            "SmolLM2-135M-Instruct",
        )
    )
    results = system.streams(go)
    assert box["outcome"] == dict.fromkeys(box["outcome"], "UNAVAILABLE"), box["outcome"]
    assert len(box["outcome"]) == 3
    assert_undisturbed(system, results, baseline)
    workers = sorted(w["id"] for w in system.cluster()["workers"])
    assert workers == (["worker-0", "worker-1"] if system.name == "ha" else ["worker-0"])


def test_an_outsider_front_end_takes_over_and_cancels_nothing(system, baseline):
    box, go = attack(
        lambda: attackers.rogue_frontend(
            f"127.0.0.1:{system.worker_port}",
            system.rogue / "frontend",
            system.victim_ids(),
        )
    )
    results = system.streams(go)
    refused = "hello: UNAVAILABLE, set priority: UNAVAILABLE"
    assert box["outcome"] == dict.fromkeys(box["outcome"], refused), box["outcome"]
    assert len(box["outcome"]) == 3
    assert_undisturbed(system, results, baseline)


def test_an_outsider_can_neither_read_nor_rewrite_the_leader_in_etcd(system, baseline):
    if system.name != "ha":
        pytest.skip("one scheduler: no etcd")
    epoch = system.cluster()["epoch"]
    rogue_server = f"127.0.0.1:{free_port()}"
    box, go = attack(
        lambda: attackers.rogue_etcd(
            f"127.0.0.1:{system.etcd_port}",
            system.rogue / "scheduler",
            rogue_server,
        )
    )
    results = system.streams(go)
    for way, outcome in box["outcome"].items():
        assert "done" not in outcome, f"{way}: {outcome}"
    assert_undisturbed(system, results, baseline)
    assert system.cluster()["epoch"] == epoch  # the same leader, never deposed


def test_a_21_mb_body_is_refused_413_and_no_stream_is_disturbed(system, baseline):
    box: dict = {}

    def go() -> None:
        box["answer"] = attackers.large_body(system.http_port)

    results = system.streams(go)
    status, body = box["answer"]
    assert status == 413, body
    assert b"--max-request-bytes" in body
    assert_undisturbed(system, results, baseline)


def test_the_cluster_map_needs_the_key_and_silent_connections_are_closed(system):
    if system.api_key:
        assert system.get("/cluster")[0] == 401
        assert system.get("/cluster", "wrong-key")[0] == 401
        assert system.get("/cluster", system.api_key)[0] == 200
    # --http-header-timeout 2: a connection that sends nothing is closed (well) within 10 s
    assert attackers.idle_connections(system.http_port, 50, wait_s=10.0) == 0
