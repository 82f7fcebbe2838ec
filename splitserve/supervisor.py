"""`splitserve up`'s supervisor: keeps schedulers, front-ends and workers running as child
processes.

A worker (or front-end, standby scheduler, local etcd) that exits without being asked to is
started again, under the same command line (so the same --worker-id), after a backoff; past
--max-restarts restarts within --restart-window it stays down and the others keep serving. A
lone scheduler (no standby) is critical: its death ends the group. A stop request (Ctrl-C,
SIGTERM, SIGHUP) stops the group in order: the workers drain (SIGTERM: they finish their running
requests), then the front-ends, the schedulers and etcd stop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from common.logging import get_logger

log = get_logger("splitserve.supervisor")

MAX_BACKOFF_S = 30.0
POLL_S = 0.1
HURRY_S = 5.0  # after SIGINT (leave now), seconds before SIGKILL
SCHEDULER_STOP_S = 15.0  # generous: the scheduler gives its own servers a 2 s grace
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # each asks `up` to stop


def _opt(default, help_text: str):
    return field(default=default, metadata={"help": help_text})


@dataclass(slots=True)
class SupervisorConfig:
    max_restarts: int = _opt(
        5, "restarts of one worker within --restart-window; at the next death it stays down"
    )
    restart_window: float = _opt(300.0, "seconds over which a worker's restarts count")
    restart_backoff: float = _opt(
        0.5,
        f"wait before restarting a dead worker; doubles with each restart still in the window "
        f"(at most {MAX_BACKOFF_S:g} s)",
    )
    stop_timeout: float = _opt(
        45.0, "on Ctrl-C/SIGTERM: seconds the workers get to drain before they are stopped"
    )


@dataclass(slots=True)
class ChildSpec:
    name: str
    argv: list[str]
    critical: bool = False  # its death ends the group (a scheduler with no standby)
    kind: str = ""  # worker | frontend | shard | scheduler | etcd: the order they stop in

    @property
    def role(self) -> str:
        """Its kind; unnamed, a critical child is the scheduler and the others are workers."""
        return self.kind or ("scheduler" if self.critical else "worker")


@dataclass(slots=True)
class Child:
    spec: ChildSpec
    popen: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: deque[float] = field(default_factory=deque)  # when, within the window
    restart_at: float | None = None  # a restart is due then
    given_up: bool = False

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


def restart_delay(restarts: deque[float], now: float, cfg: SupervisorConfig) -> float | None:
    """Seconds to wait before the next restart, or None past the limit. Forgets restarts older
    than the window first, so a worker that stayed up a whole window starts over at the
    shortest wait."""
    while restarts and restarts[0] <= now - cfg.restart_window:
        restarts.popleft()
    if len(restarts) >= cfg.max_restarts:
        return None
    return min(MAX_BACKOFF_S, cfg.restart_backoff * 2 ** len(restarts))


def describe_exit(code: int) -> dict:
    if code < 0:
        try:
            return {"signal": signal.Signals(-code).name}
        except ValueError:
            return {"signal": -code}
    return {"exit_code": code}


def spawn_process(argv: list[str], env: dict[str, str], nice: int = 0) -> subprocess.Popen:
    # a process group of its own: the terminal's Ctrl-C reaches only `up`, which then stops
    # the children in order (workers drain before the scheduler goes). The niceness is set from
    # here, not by a preexec_fn: Python code between fork and exec runs gRPC's fork handlers,
    # which abort the child while another thread of `up` (the demo's client) is in gRPC
    popen = subprocess.Popen(argv, env=env, process_group=0)
    if nice:
        with contextlib.suppress(OSError):  # gone already: its exit is seen as any other
            own = os.getpriority(os.PRIO_PROCESS, 0)
            os.setpriority(os.PRIO_PROCESS, popen.pid, own + nice)
    return popen


class Supervisor:
    def __init__(
        self,
        cfg: SupervisorConfig,
        specs: list[ChildSpec],
        spawn: Callable[[list[str]], subprocess.Popen],
    ) -> None:
        self.cfg = cfg
        self.children = [Child(spec) for spec in specs]
        self._spawn = spawn
        self.stop_requests: list[str] = []  # signal names, in order

    def request_stop(self, signum: int, frame=None) -> None:
        """A signal handler: the first asks for an orderly stop, a second to hurry."""
        self.stop_requests.append(signal.Signals(signum).name)

    @property
    def stopping(self) -> bool:
        return bool(self.stop_requests)

    @contextlib.contextmanager
    def catch_stop_signals(self):
        """Within the block, SIGINT (Ctrl-C), SIGTERM and SIGHUP are stop requests; the
        previous handlers come back after it. Enter it on the main thread (Python runs signal
        handlers there only) and run the supervisor inside it.

        Catching them is also what lets the children obey the signals that stop them: exec
        resets a caught signal to its default action but keeps an ignored one ignored, and a
        process started in the background by a non-interactive shell (`make test &`, a script,
        some CI runners) starts with SIGINT ignored. Python keeps an inherited SIG_IGN rather
        than raise KeyboardInterrupt, so children spawned while SIGINT was ignored here would
        ignore the SIGINT that stops the scheduler and hurries a draining worker, and be
        killed at the end of the wait instead (`up` exiting 1)."""
        previous = {sig: signal.signal(sig, self.request_stop) for sig in STOP_SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                # None: a handler not set from Python; the default is the nearest we can do
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def run(self) -> int:
        """Start every child, supervise until a stop request or the scheduler's death, stop
        the rest. Returns the exit code: 0 after a stop request that every child obeyed in
        time, 1 when the scheduler died or a child had to be killed."""
        ignored = [sig.name for sig in STOP_SIGNALS if signal.getsignal(sig) == signal.SIG_IGN]
        if ignored:  # see catch_stop_signals
            log.warning(
                "stop_signals_ignored",
                signals=ignored,
                message=(
                    f"{', '.join(ignored)} ignored here: the children inherit that and will "
                    "not obey them; run the supervisor inside catch_stop_signals()"
                ),
            )
        try:
            for child in self.children:
                self._start(child)
            while not self.stopping:
                now = time.monotonic()
                for child in self.children:
                    if child.popen is not None and (code := child.popen.poll()) is not None:
                        child.popen = None
                        if child.spec.critical:
                            self._critical_exit(child, code)
                            return 1
                        self._worker_exit(child, code, now)
                    elif child.restart_at is not None and now >= child.restart_at:
                        if self.stopping:  # asked during this round: start nothing more
                            break
                        self._start(child)
                time.sleep(POLL_S)
            return self._stop()
        finally:  # whatever went wrong here, leave no child behind (they have their own groups)
            for child in self.children:
                if child.running:
                    child.popen.kill()
                    child.popen.wait()

    def _start(self, child: Child) -> None:
        child.restart_at = None
        child.popen = self._spawn(child.spec.argv)
        child.started_at = time.monotonic()
        log.info(
            "child_started",
            child=child.spec.name,
            pid=child.popen.pid,
            restarts=len(child.restarts),
        )

    def _worker_exit(self, child: Child, code: int, now: float) -> None:
        delay = restart_delay(child.restarts, now, self.cfg)
        uptime_s = round(now - child.started_at, 2)
        if delay is None:
            child.given_up = True
            left = [c.spec.name for c in self._workers() if c.running or c.restart_at]
            log.error(
                "worker_left_down",
                child=child.spec.name,
                uptime_s=uptime_s,
                **describe_exit(code),
                message=(
                    f"{child.spec.name} died again after {len(child.restarts)} restarts within "
                    f"{self.cfg.restart_window:g} s (--max-restarts {self.cfg.max_restarts}, "
                    f"--restart-window {self.cfg.restart_window:g}); it stays down. "
                    + (
                        f"Still serving: {', '.join(left)}"
                        if left
                        else "No worker is left: requests wait for one to attach"
                    )
                ),
            )
            return
        child.restarts.append(now)
        child.restart_at = now + delay
        log.warning(
            "worker_died" if child.spec.role == "worker" else "child_died",
            child=child.spec.name,
            uptime_s=uptime_s,
            **describe_exit(code),
            restart_in_s=delay,
            restart=len(child.restarts),
            max_restarts=self.cfg.max_restarts,
        )

    def _critical_exit(self, child: Child, code: int) -> None:
        log.error(
            "scheduler_died",
            child=child.spec.name,
            **describe_exit(code),
            message=(
                f"{child.spec.name} exited and there is no standby scheduler: "
                "stopping the workers; splitserve up exits 1"
            ),
        )
        # nothing to drain into: the others leave at once
        self._stop_group([c for c in self.children if c.running], signal.SIGINT, HURRY_S)

    def _stop(self) -> int:
        log.info(
            "stopping",
            signal=self.stop_requests[0],
            message=(
                f"the workers drain (up to {self.cfg.stop_timeout:g} s; a second Ctrl-C "
                "hurries them), then the scheduler stops"
            ),
        )
        for child in self.children:
            child.restart_at = None
        killed = self._stop_group(self._workers(), signal.SIGTERM, self.cfg.stop_timeout)
        for kind in ("frontend", "shard", "scheduler", "etcd"):
            group = [c for c in self.children if c.spec.role == kind]
            killed |= self._stop_group(group, signal.SIGINT, SCHEDULER_STOP_S)
        code = 1 if killed else 0
        log.info("stopped", exit_code=code)
        return code

    def _stop_group(self, children: list[Child], sig: signal.Signals, timeout: float) -> bool:
        """Signal these children, wait for them; SIGINT on a second stop request, SIGKILL
        past the timeout. Returns whether one had to be killed."""
        live = [c for c in children if c.running]
        for child in live:
            child.popen.send_signal(sig)
        deadline = time.monotonic() + timeout
        # not hurried yet even when the second request came in before this began (two quick
        # Ctrl-Cs, or a loop that the load kept from looking between them): the first round
        # below sends the SIGINT then; counting that case as hurried sent none, and a worker
        # drained for the whole --stop-timeout
        hurried = sig == signal.SIGINT
        while any(c.running for c in live):
            now = time.monotonic()
            if not hurried and len(self.stop_requests) > 1:
                hurried = True
                deadline = min(deadline, now + HURRY_S)
                for child in live:
                    if child.running:
                        child.popen.send_signal(signal.SIGINT)
            if now >= deadline:
                break
            time.sleep(POLL_S)
        killed = False
        for child in live:
            if child.running:
                log.warning(
                    "child_killed", child=child.spec.name, message="it did not stop in time"
                )
                child.popen.kill()
                killed = True
            code = child.popen.wait()
            log.info("child_stopped", child=child.spec.name, **describe_exit(code))
        return killed

    def _workers(self) -> list[Child]:
        return [c for c in self.children if c.spec.role == "worker"]
