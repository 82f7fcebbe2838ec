"""`splitserve up --workers N` starts a scheduler and N workers, and stops them on SIGINT."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil
import pytest

from common.client import SplitserveClient
from tests.e2e.procs import ROOT, free_port

pytestmark = [pytest.mark.e2e]


def test_up_starts_and_stops_everything(tmp_path):
    port, worker_port = free_port(), free_port()
    log = open(tmp_path / "up.log", "wb")
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "splitserve.cli",
            "up",
            "--workers",
            "2",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-port",
            str(worker_port),
            "--http-port",
            "0",
            "--api-key",
            "sekrit",
            "--worker-secret",
            "w-sekrit",
            "--worker-arg=--simulate",
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        with SplitserveClient(f"127.0.0.1:{port}", api_key="sekrit", timeout=30) as client:
            info = client.wait_for_workers(2, timeout=90)
            assert sorted(w.worker_id for w in info.workers) == ["worker-0", "worker-1"]
            result = client.generate(token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
            assert len(result.token_ids) == 4
        children = psutil.Process(up.pid).children()
        assert len(children) == 3
        for child in children:  # secrets are not on any command line
            assert not any("sekrit" in part for part in child.cmdline())
        up.send_signal(signal.SIGINT)
        assert up.wait(30) == 0
        assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
    finally:
        if up.poll() is None:
            up.kill()
        log.close()
