"""Start real scheduler and worker processes on loopback for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> int:
        if self.alive():
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


@dataclass
class Cluster:
    """A scheduler and its workers, started as `splitserve` processes."""

    tmp: Path
    port: int = field(default_factory=free_port)
    worker_port: int = field(default_factory=free_port)
    procs: list[Proc] = field(default_factory=list)
    scheduler: Proc | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _spawn(self, name: str, args: list[str], env_extra: dict | None = None) -> Proc:
        log_path = self.tmp / f"{name}-{len(self.procs)}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
        popen = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", *args],
            cwd=ROOT,
            env=env,
            stdout=open(log_path, "wb"),
            stderr=subprocess.STDOUT,
        )
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        return proc

    def start_scheduler(self, *extra: str) -> Proc:
        self.scheduler = self._spawn(
            "scheduler",
            [
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--worker-port",
                str(self.worker_port),
                "--http-port",
                "0",
                *extra,
            ],
        )
        wait_for_port(self.port, self.scheduler)
        return self.scheduler

    def start_worker(self, worker_id: str, *extra: str) -> Proc:
        return self._spawn(
            worker_id,
            [
                "worker",
                "--scheduler",
                f"127.0.0.1:{self.worker_port}",
                "--worker-id",
                worker_id,
                "--num-threads",
                "1",
                *extra,
            ],
        )

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    def logs(self) -> str:
        return "\n".join(f"===== {p.name} =====\n{p.log()[-4000:]}" for p in self.procs)


def wait_for_port(port: int, proc: Proc, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited early:\n{proc.log()}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{proc.name} did not listen on {port}:\n{proc.log()}")


def interrupt(popen: subprocess.Popen, timeout: float = 90.0) -> None:
    """Stop a process as Ctrl-C does (`splitserve up` then stops its children in order); kill
    it if it has not exited within `timeout`."""
    popen.send_signal(signal.SIGINT)
    try:
        popen.wait(timeout)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait()
