"""`splitserve up`'s supervisor over stand-in child processes (a few lines of Python each)."""

from __future__ import annotations

import contextlib
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
    STOP_SIGNALS,
    ChildSpec,
    Supervisor,
    SupervisorConfig,
    restart_delay,
    spawn_process,
)

SLEEPS = [sys.executable, "-c", "import time; time.sleep(60)"]
CRASHES = [sys.executable, "-c", "import sys; sys.exit(3)"]
# bounds on waits for something that happens within a second on a quiet machine: generous, so
# that they hold on a loaded one (they bound a failing test, they time nothing)
WAIT_S = 60.0
STOP_WAIT_S = 90.0  # a whole stop: SIGKILL comes after at most 15 s for the scheduler


def drains_slowly(ready: Path, draining: Path | None = None) -> list[str]:
    """A worker that does not leave on SIGTERM (a long drain): it only touches `draining`
    then; `ready` once it behaves so. SIGINT (or SIGKILL) ends it."""
    on_term = "lambda *_: pathlib.Path(sys.argv[2]).touch()" if draining else "signal.SIG_IGN"
    code = (
        f"import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, {on_term}); "
        "pathlib.Path(sys.argv[1]).touch(); time.sleep(600)"
    )
    return [sys.executable, "-c", code, str(ready), *([str(draining)] if draining else [])]


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
    """spawn_process, recording what each child was (its code) and when it started."""

    def __init__(self) -> None:
        self.started: list[tuple[str, float, object]] = []

    def __call__(self, argv: list[str]):
        popen = spawn_process(argv, dict(os.environ))
        self.started.append((argv[2], time.monotonic(), popen))
        return popen

    def of(self, argv: list[str]) -> list[tuple[float, object]]:
        return [(t, p) for code, t, p in self.started if code == argv[2]]


def wait_until(predicate, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@contextlib.contextmanager
def supervising(supervisor: Supervisor):
    """Run it in a thread as `up` runs it: its stop signals caught on this (the main) thread,
    which also gives the children those signals at their default whatever this process was
    started with. Yields the thread and a list that gets run()'s exit code."""
    result: list[int] = []
    with supervisor.catch_stop_signals():
        thread = threading.Thread(target=lambda: result.append(supervisor.run()), daemon=True)
        thread.start()
        try:
            yield thread, result
        finally:  # a failed test: stop it, hurried, before the handlers go back
            if thread.is_alive():
                supervisor.request_stop(signal.SIGINT)
                supervisor.request_stop(signal.SIGINT)
                thread.join(STOP_WAIT_S)


@pytest.fixture
def spawns():
    s = Spawns()
    yield s
    for _, _, popen in s.started:  # whatever a failed test left
        if popen.poll() is None:
            popen.kill()
            popen.wait()


def ignored_signals(pid: int) -> set[signal.Signals]:
    """The stop signals that process ignores (Linux: /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(ln for ln in status.splitlines() if ln.startswith("SigIgn:")).split()[1], 16)
    return {sig for sig in STOP_SIGNALS if mask & (1 << (sig - 1))}


def test_a_worker_that_dies_at_every_start_is_left_down_after_max_restarts(spawns):
    cfg = SupervisorConfig(max_restarts=3, restart_window=60.0, restart_backoff=0.05)
    specs = [
        ChildSpec("scheduler", SLEEPS, critical=True),
        ChildSpec("worker-0", [*SLEEPS[:-1], SLEEPS[-1] + " # worker-0"]),
        ChildSpec("worker-1", CRASHES),
    ]
    supervisor = Supervisor(cfg, specs, spawns)
    with supervising(supervisor) as (thread, result):
        crashing = supervisor.children[2]
        wait_until(lambda: crashing.given_up)
        assert crashing.restart_at is None  # nothing more is due
        assert thread.is_alive()  # the group keeps serving
        assert supervisor.children[0].running and supervisor.children[1].running
        os.kill(os.getpid(), signal.SIGTERM)  # as `up` gets it: a stop request
        thread.join(STOP_WAIT_S)
    assert supervisor.stop_requests == ["SIGTERM"]
    assert result == [0]  # every child obeyed: none was killed
    # it stayed down from then to the end, and the others were never restarted
    starts = [t for t, _ in spawns.of(CRASHES)]
    assert len(starts) == 1 + 3
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert all(gap >= delay for gap, delay in zip(gaps, [0.05, 0.1, 0.2], strict=True)), gaps
    assert len(spawns.started) == 2 + 4
    assert all(p.poll() is not None for _, _, p in spawns.started)


def test_children_obey_the_stop_signals_that_up_was_started_ignoring(spawns, tmp_path):
    """A background job of a non-interactive shell (`make test &`) starts with SIGINT ignored,
    and exec keeps an ignored signal ignored: a scheduler spawned so ignored the SIGINT that
    stops it and was killed 15 s later. Caught by the supervisor, the stop signals reach the
    children at their default."""
    ready = tmp_path / "ready"
    # the worker catches SIGTERM (rather than ignoring it) so that its own drain does not show
    # in the ignored set the test reads
    worker = drains_slowly(ready, tmp_path / "draining")
    specs = [ChildSpec("scheduler", SLEEPS, critical=True), ChildSpec("w", worker)]
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
    try:
        supervisor = Supervisor(SupervisorConfig(stop_timeout=600.0), specs, spawns)
        with supervising(supervisor) as (thread, result):
            wait_until(lambda: len(spawns.started) == 2)
            if Path("/proc/self/status").exists():
                assert [ignored_signals(p.pid) for _, _, p in spawns.started] == [set(), set()]
            wait_until(ready.exists)
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # and hurried: the worker leaves on SIGINT only
            thread.join(STOP_WAIT_S)
        assert result == [0]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_the_scheduler_dying_stops_the_workers_at_once_and_exits_1(spawns, tmp_path):
    ready = tmp_path / "ready"
    worker = [
        sys.executable,
        "-c",
        "import pathlib, sys, time; pathlib.Path(sys.argv[1]).touch(); time.sleep(60)",
        str(ready),
    ]
    # it dies once the worker is up (and has Python's SIGINT handler: KeyboardInterrupt)
    scheduler = [
        sys.executable,
        "-c",
        "import pathlib, sys, time\n"
        "for _ in range(60_000):\n"
        "    if pathlib.Path(sys.argv[1]).exists(): break\n"
        "    time.sleep(0.01)\n"
        "sys.exit(7)",
        str(ready),
    ]
    specs = [ChildSpec("scheduler", scheduler, critical=True), ChildSpec("worker-0", worker)]
    supervisor = Supervisor(SupervisorConfig(stop_timeout=600.0), specs, spawns)
    with supervisor.catch_stop_signals():
        assert supervisor.run() == 1
    assert [p.returncode for _, _, p in spawns.started] == [7, -signal.SIGINT]  # not drained
    assert len(spawns.started) == 2  # no restart of anything


def test_a_second_stop_request_hurries_a_draining_worker(spawns, tmp_path):
    ready, draining = tmp_path / "ready", tmp_path / "draining"
    worker = drains_slowly(ready, draining)
    specs = [ChildSpec("scheduler", SLEEPS, critical=True), ChildSpec("w", worker)]
    # a drain longer than any wait here: only the hurry can end it without a SIGKILL
    supervisor = Supervisor(SupervisorConfig(stop_timeout=600.0), specs, spawns)
    with supervising(supervisor) as (thread, result):
        wait_until(ready.exists)
        supervisor.request_stop(signal.SIGINT)
        wait_until(draining.exists)  # it got the SIGTERM and drains
        assert supervisor.children[1].running
        supervisor.request_stop(signal.SIGINT)
        thread.join(STOP_WAIT_S)
    assert result == [0]  # nothing killed: the SIGINT ended the drain
    assert spawns.of(worker)[0][1].returncode == -signal.SIGINT


def test_two_stop_requests_before_the_supervisor_looks_still_hurry_the_workers(spawns, tmp_path):
    """Two quick Ctrl-Cs, or a loaded machine that kept the supervisor's loop from running
    between them: the stop begins with both in. It sent SIGTERM only and waited out the whole
    --stop-timeout (the workers counted as hurried, but no SIGINT sent)."""
    ready = tmp_path / "ready"
    worker = drains_slowly(ready)
    supervisor: Supervisor

    def spawn(argv: list[str]):
        popen = spawns(argv)
        if argv == worker:  # the last child: both requests are in before the loop begins
            wait_until(ready.exists)
            supervisor.request_stop(signal.SIGINT)
            supervisor.request_stop(signal.SIGINT)
        return popen

    specs = [ChildSpec("scheduler", SLEEPS, critical=True), ChildSpec("w", worker)]
    supervisor = Supervisor(SupervisorConfig(stop_timeout=600.0), specs, spawn)
    with supervising(supervisor) as (thread, result):
        thread.join(STOP_WAIT_S)
    assert result == [0]
    assert spawns.of(worker)[0][1].returncode == -signal.SIGINT


def test_a_worker_that_outlasts_the_stop_timeout_is_killed(spawns, tmp_path):
    ready = tmp_path / "ready"
    worker = drains_slowly(ready)
    specs = [ChildSpec("scheduler", SLEEPS, critical=True), ChildSpec("w", worker)]
    supervisor = Supervisor(SupervisorConfig(stop_timeout=0.3), specs, spawns)
    with supervising(supervisor) as (thread, result):
        wait_until(ready.exists)
        supervisor.request_stop(signal.SIGTERM)
        thread.join(STOP_WAIT_S)
    assert result == [1]
    assert spawns.of(worker)[0][1].returncode == -signal.SIGKILL
    assert all(p.poll() is not None for _, _, p in spawns.started)


def test_a_worker_runs_nicer_than_up_and_its_own_process_group():
    popen = spawn_process(["sleep", "30"], dict(os.environ), nice=5)
    try:
        assert os.getpriority(os.PRIO_PROCESS, popen.pid) == os.getpriority(os.PRIO_PROCESS, 0) + 5
        assert os.getpgid(popen.pid) == popen.pid  # Ctrl-C on the terminal reaches only `up`
    finally:
        popen.kill()
        popen.wait()
