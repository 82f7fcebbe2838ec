"""`splitserve up --workers 2 --schedulers 2 --frontends 2` on loopback, as the failover test
and bench/failover.py start it, its readiness as GET /cluster reports it, and workers started
by hand beside it."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path

from tests.e2e.procs import free_port


def ha_up_argv(
    port: int, http_port: int, *flags: str, workers: int = 2, etcd_port: int = 0
) -> list[str]:
    cluster = ["--schedulers", "2", "--frontends", "2", "--host", "127.0.0.1"]
    cluster += ["--workers", str(workers)]
    ports = ["--port", str(port), "--http-port", str(http_port)]
    ports += ["--worker-port", str(free_port()), "--etcd-port", str(etcd_port or free_port())]
    return [sys.executable, "-m", "splitserve.cli", "up", *cluster, *ports, *flags]


def worker_argv(etcd_port: int, state_dir: Path, worker_id: str, *flags: str) -> list[str]:
    """A worker started by hand beside `up --state-dir state_dir`: it finds the leader in
    that cluster's etcd and shows the worker certificate `up` made."""
    cli = [sys.executable, "-m", "splitserve.cli", "worker", "--worker-id", worker_id]
    credentials = str(state_dir / "credentials" / "worker")
    return [*cli, "--etcd", f"127.0.0.1:{etcd_port}", "--credentials", credentials, *flags]


def cluster_body(http_port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/cluster", timeout=2) as r:
            return json.loads(r.read())
    except Exception:  # noqa: BLE001 - not up (or no leader) yet
        return None


def wait_ha_ready(
    http_port: int, popen, log_path: Path, min_epoch: int = 1, timeout: float = 300.0
) -> dict:
    """The cluster once a leader of at least min_epoch sees 2 schedulers, 2 front-ends and
    2 active workers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError("splitserve up exited:\n" + log_path.read_text()[-5000:])
        body = cluster_body(http_port)
        if (
            body
            and body["epoch"] >= min_epoch
            and sum(w["state"] == "active" for w in body["workers"]) == 2
            and len(body["frontends"]) == 2
            and len(body["schedulers"]) == 2
        ):
            return body
        time.sleep(0.3)
    raise TimeoutError(log_path.read_text()[-8000:])
