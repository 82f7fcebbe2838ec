"""`splitserve up --workers N`: a scheduler and N workers under a supervisor that restarts a
worker that dies, stops the group in order on SIGINT/SIGTERM, and stops it when the scheduler
dies. Simulated workers (`--simulate`): the supervision does not need a model."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import pytest

from common.client import FINISH_NAMES, SplitserveClient
from tests.e2e.procs import ROOT, free_port, interrupt
from worker_svc.sim_runner import sim_next_token

pytestmark = [pytest.mark.e2e]

SIM_VOCAB = 49152  # the default model's: a simulated worker takes its model's
SLOW_SIM = ("--worker-arg=--simulate", "--worker-arg=--sim-step-base-ms=20")


@dataclass
class Up:
    popen: subprocess.Popen
    port: int
    log_path: Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.popen.pid).children()
        except psutil.NoSuchProcess:
            return []

    def worker(self, worker_id: str) -> psutil.Process | None:
        for child in self.children():
            with contextlib.suppress(psutil.Error):
                if worker_id in child.cmdline():
                    return child
        return None


@contextlib.contextmanager
def splitserve_up(tmp_path: Path, *flags: str):
    port = free_port()
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "splitserve.cli",
                "up",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--worker-port",
                str(free_port()),
                "--http-port",
                "0",
                *flags,
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, SPLITSERVE_STATE_DIR=str(tmp_path / "state")),
        )
    up = Up(popen, port, log_path)
    seen: dict[int, psutil.Process] = {}
    try:
        yield up
    finally:
        seen.update((c.pid, c) for c in up.children())
        if popen.poll() is None:
            interrupt(popen, 30)
        for child in seen.values():  # its own process group: not stopped with a killed `up`
            with contextlib.suppress(psutil.Error):
                child.kill()


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for(predicate, timeout: float, what: str, up: Up):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} not within {timeout:g} s; up's log:\n{up.log()[-6000:]}")


def sim_reference(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(sim_next_token(seq, SIM_VOCAB))
    return seq[len(prompt) :]


class Streams:
    """Streaming requests in threads, each recording its tokens, workers and end."""

    def __init__(self, client: SplitserveClient, n: int, max_tokens: int) -> None:
        self.prompts = [[11, 12, 13, i] for i in range(n)]
        self.max_tokens = max_tokens
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.workers: list[list[str]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.errors: list[str] = []
        self.started = [threading.Event() for _ in range(n)]
        self.threads = [
            threading.Thread(target=self._one, args=(client, i), daemon=True) for i in range(n)
        ]
        for thread in self.threads:
            thread.start()

    def _one(self, client: SplitserveClient, i: int) -> None:
        try:
            stream = client.stream(
                token_ids=self.prompts[i], max_tokens=self.max_tokens, ignore_eos=True
            )
            for msg in stream:
                self.tokens[i].extend(msg.token_ids)
                if msg.worker_id and msg.worker_id not in self.workers[i]:
                    self.workers[i].append(msg.worker_id)
                self.started[i].set()
                if msg.finish_reason:
                    self.finish[i] = FINISH_NAMES[msg.finish_reason]
                    if msg.error:
                        self.errors.append(f"request {i}: {msg.error}")
        except grpc.RpcError as exc:
            self.errors.append(f"request {i}: {exc.code().name}: {exc.details()}")
        finally:
            self.started[i].set()

    def wait_started(self, timeout: float) -> None:
        for event in self.started:
            assert event.wait(timeout)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.1, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a request never ended"

    def check_all_finished(self) -> None:
        assert not self.errors, self.errors
        assert self.finish == ["length"] * len(self.prompts)
        for prompt, tokens in zip(self.prompts, self.tokens, strict=True):
            assert tokens == sim_reference(prompt, self.max_tokens)  # each token once, in order


def test_up_starts_and_stops_everything(tmp_path):
    flags = ("--workers", "2", "--api-key", "sekrit")
    with splitserve_up(tmp_path, *flags, "--worker-arg=--simulate") as up:
        with SplitserveClient(up.target, api_key="sekrit", timeout=30) as client:
            info = client.wait_for_workers(2, timeout=90)
            assert sorted(w.worker_id for w in info.workers) == ["worker-0", "worker-1"]
            result = client.generate(token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
            assert len(result.token_ids) == 4
        children = up.children()
        assert len(children) == 3
        for child in children:  # secrets are not on any command line, nor keys
            assert not any("sekrit" in part or "PRIVATE KEY" in part for part in child.cmdline())
        # up made the cluster's credentials in its state directory, private to this user
        credentials = tmp_path / "state" / "credentials"
        assert (credentials / "ca" / "ca.key").stat().st_mode & 0o077 == 0
        roles = [child.cmdline()[child.cmdline().index("--credentials") + 1] for child in children]
        assert sorted(roles) == sorted(
            str(credentials / r) for r in ("scheduler", "worker", "worker")
        )
        up.popen.send_signal(signal.SIGINT)
        assert up.popen.wait(30) == 0
        assert not any(alive(c) for c in children)


def test_a_killed_worker_is_restarted_under_its_id_and_no_request_fails(tmp_path):
    with splitserve_up(tmp_path, "--workers", "2", *SLOW_SIM) as up:
        with SplitserveClient(up.target, timeout=60) as client:
            client.wait_for_workers(2, timeout=90)
            streams = Streams(client, 12, max_tokens=150)
            streams.wait_started(30)
            victim = up.worker("worker-1")
            assert victim is not None
            victim.kill()
            killed_at = time.monotonic()
            streams.join(60)
            streams.check_all_finished()
            assert any(w[:1] == ["worker-1"] and len(w) > 1 for w in streams.workers)

            def rejoined():
                ids = [w.worker_id for w in client.server_info().workers]
                return sorted(ids) == ["worker-0", "worker-1"]

            wait_for(rejoined, 30, "worker-1 attached again", up)
            restart_s = time.monotonic() - killed_at
            successor = up.worker("worker-1")
            assert successor is not None and successor.pid != victim.pid
            assert up.popen.poll() is None
            log = up.log()
            assert '"signal": "SIGKILL"' in log and '"event": "worker_died"' in log
            print(f"worker-1 attached again {restart_s:.2f} s after its kill")


def test_a_worker_that_dies_at_every_start_is_left_down_and_the_rest_serve(tmp_path):
    flags = ("--workers", "2", "--max-restarts", "2", "--restart-backoff", "0.1")
    with splitserve_up(tmp_path, *flags, "--worker-arg=--simulate") as up:
        killed: set[int] = set()
        for _ in range(1 + 2):

            def fresh_worker_1():
                proc = up.worker("worker-1")
                return proc if proc is not None and proc.pid not in killed else None

            proc = wait_for(fresh_worker_1, 30, "a worker-1 process", up)
            proc.kill()
            killed.add(proc.pid)
        wait_for(lambda: '"event": "worker_left_down"' in up.log(), 10, "worker_left_down", up)
        time.sleep(1.0)
        assert up.worker("worker-1") is None  # not started again
        assert up.popen.poll() is None
        with SplitserveClient(up.target, timeout=30) as client:
            info = client.wait_for_workers(1, timeout=60)
            assert [w.worker_id for w in info.workers] == ["worker-0"]
            result = client.generate(token_ids=[5, 6, 7], max_tokens=8, ignore_eos=True)
            assert result.finish_reason == "length" and result.worker_ids == ["worker-0"]
        assert "worker-1 died again after 2 restarts" in up.log()


def test_sigterm_drains_the_workers_then_stops_the_scheduler_and_exits_0(tmp_path):
    with splitserve_up(tmp_path, "--workers", "2", *SLOW_SIM) as up:
        with SplitserveClient(up.target, timeout=60) as client:
            client.wait_for_workers(2, timeout=90)
            streams = Streams(client, 2, max_tokens=100)
            streams.wait_started(30)
            children = up.children()
            up.popen.send_signal(signal.SIGTERM)
            streams.join(60)
            streams.check_all_finished()  # drained: the running requests finish
        assert up.popen.wait(60) == 0
        assert len(children) == 3 and not any(alive(c) for c in children)
        log = up.log()
        assert log.rindex('"event": "worker_stopped"') < log.index('"event": "scheduler_stopped"')


def test_the_scheduler_dying_ends_up_with_exit_1_and_no_orphan_workers(tmp_path):
    with splitserve_up(tmp_path, "--workers", "2", "--worker-arg=--simulate") as up:
        with SplitserveClient(up.target, timeout=30) as client:
            client.wait_for_workers(2, timeout=90)
        children = up.children()
        scheduler = next(c for c in children if "scheduler" in c.cmdline()[3:4])
        scheduler.kill()
        assert up.popen.wait(30) == 1
        assert len(children) == 3 and not any(alive(c) for c in children)
        assert '"event": "scheduler_died"' in up.log()
