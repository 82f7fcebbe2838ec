"""`splitserve up`'s supervisor over stand-in child processes (a few lines of Python each)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import deque
from pathlib import Path

import pytest

from splitserve.supervisor import (
    MAX_BACKOFF_S,
    ChildSpec,
    Supervisor,
    SupervisorConfig,
    restart_delay,
    spawn_process,
)

SLEEPS = [sys.executable, "-c", "import time; time.sleep(60)"]
CRASHES = [sys.executable, "-c", "import sys; sys.exit(3)"]


def ignores_sigterm(ready: Path) -> list[str]:
    """A child that ignores SIGTERM (a worker that drains slowly); `ready` once it does."""
    code = (
        "import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "pathlib.Path(sys.argv[1]).touch(); time.sleep(60)"
    )
    return [sys.executable, "-c", code, str(ready)]


def test_backoff_doubles_per_restart_in_the_window_and_stops_at_the_limit():
    cfg = SupervisorConfig(max_restarts=5, restart_window=100.0, restart_backoff=0.5)
    restarts: deque[float] = deque()
    delays = []
    for now in range(6):
        delays.append(restart_delay(restarts, float(now), cfg))
        restarts.append(float(now))
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, None]
    # a worker that stayed up a whole window starts over at the shortest wait
    assert restart_delay(restarts, 200.0, cfg) == 0.5 and not restarts


def test_backoff_is_capped():
    cfg = SupervisorConfig(max_restarts=50, restart_window=1000.0, restart_backoff=0.5)
    restarts = deque(float(t) for t in range(20))
    assert restart_delay(restarts, 20.0, cfg) == MAX_BACKOFF_S


def test_no_restart_when_max_restarts_is_zero():
    assert restart_delay(deque(), 0.0, SupervisorConfig(max_restarts=0)) is None


class Spawns:
    """spawn_process, recording when each child started."""

    def __init__(self) -> None:
        self.started: list[tuple[str, float, object]] = []

    def __call__(self, argv: list[str]):
        popen = spawn_process(argv, dict(os.environ))
        self.started.append((argv[-1], time.monotonic(), popen))
        return popen

    def of(self, argv: list[str]) -> list[tuple[float, object]]:
        return [(t, p) for code, t, p in self.started if code == argv[-1]]


def run_in_thread(supervisor: Supervisor) -> tuple[threading.Thread, list[int]]:
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(supervisor.run()), daemon=True)
    thread.start()
    return thread, result


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def spawns():
    s = Spawns()
    yield s
    for _, _, popen in s.started:  # whatever a failed test left
        if popen.poll() is None:
            popen.kill()
            popen.wait()


def test_a_worker_that_dies_at_every_start_is_left_down_after_max_restarts(spawns):
    cfg = SupervisorConfig(max_restarts=3, restart_window=60.0, restart_backoff=0.05)
    specs = [
        ChildSpec("scheduler", SLEEPS, critical=True),
        ChildSpec("worker-0", [*SLEEPS[:-1], SLEEPS[-1] + " # worker-0"]),
        ChildSpec("worker-1", CRASHES),
    ]
    supervisor = Supervisor(cfg, specs, spawns)
    thread, result = run_in_thread(supervisor)
    crashing = supervisor.children[2]
    wait_until(lambda: crashing.given_up)
    time.sleep(0.5)  # and it stays down
    starts = [t for t, _ in spawns.of(CRASHES)]
    assert len(starts) == 1 + 3
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert all(gap >= delay for gap, delay in zip(gaps, [0.05, 0.1, 0.2], strict=True)), gaps
    assert thread.is_alive()  # the group keeps serving
    assert supervisor.children[0].running and supervisor.children[1].running
    assert len(spawns.started) == 2 + 4  # the others were never restarted
    supervisor.request_stop(signal.SIGTERM)
    thread.join(20)
    assert result == [0]
    assert all(p.poll() is not None for _, _, p in spawns.started)


def test_the_scheduler_dying_stops_the_workers_and_exits_1(spawns):
    scheduler = [sys.executable, "-c", "import sys, time; time.sleep(0.3); sys.exit(7)"]
    specs = [ChildSpec("scheduler", scheduler, critical=True), ChildSpec("worker-0", SLEEPS)]
    supervisor = Supervisor(SupervisorConfig(), specs, spawns)
    started = time.monotonic()
    assert supervisor.run() == 1
    assert time.monotonic() - started < 10
    assert all(p.poll() is not None for _, _, p in spawns.started)
    assert len(spawns.started) == 2  # no restart of anything


def test_a_second_stop_request_hurries_a_draining_worker(spawns, tmp_path):
    ready = tmp_path / "ready"
    specs = [ChildSpec("scheduler", SLEEPS, critical=True), ChildSpec("w", ignores_sigterm(ready))]
    supervisor = Supervisor(SupervisorConfig(stop_timeout=60.0), specs, spawns)
    thread, result = run_in_thread(supervisor)
    wait_until(ready.exists)
    supervisor.request_stop(signal.SIGINT)
    time.sleep(0.3)
    assert supervisor.children[1].running  # still "draining"
    started = time.monotonic()
    supervisor.request_stop(signal.SIGINT)
    thread.join(20)
    assert result == [0] and time.monotonic() - started < 5


def test_a_worker_that_outlasts_the_stop_timeout_is_killed(spawns, tmp_path):
    ready = tmp_path / "ready"
    specs = [ChildSpec("scheduler", SLEEPS, critical=True), ChildSpec("w", ignores_sigterm(ready))]
    supervisor = Supervisor(SupervisorConfig(stop_timeout=0.3), specs, spawns)
    thread, result = run_in_thread(supervisor)
    wait_until(ready.exists)
    supervisor.request_stop(signal.SIGTERM)
    thread.join(20)
    assert result == [1]
    assert all(p.poll() is not None for _, _, p in spawns.started)


def test_a_worker_runs_nicer_than_up_and_its_own_process_group():
    popen = spawn_process(["sleep", "30"], dict(os.environ), nice=5)
    try:
        assert os.getpriority(os.PRIO_PROCESS, popen.pid) == os.getpriority(os.PRIO_PROCESS, 0) + 5
        assert os.getpgid(popen.pid) == popen.pid  # Ctrl-C on the terminal reaches only `up`
    finally:
        popen.kill()
        popen.wait()
