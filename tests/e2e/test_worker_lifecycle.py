"""Workers come and go; a scheduler with none answers UNAVAILABLE after waiting."""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from common.client import SplitserveClient
from tests.e2e.conftest import SCHEDULER_FLAGS, WORKER_FLAGS
from tests.e2e.procs import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_no_worker_is_unavailable_after_the_wait(tmp_path):
    c = Cluster(tmp_path)
    try:
        c.start_scheduler("--worker-wait-timeout", "1")
        with SplitserveClient(c.target, timeout=30) as client:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                client.generate("hello", max_tokens=2)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no worker" in err.value.details()
            assert time.monotonic() - started >= 0.9
            info = client.server_info()
            assert info.num_requests_in_flight == 0 and not info.workers
    finally:
        c.stop_all()


def test_worker_restart_reattaches_and_scheduler_restart_too(tmp_path):
    c = Cluster(tmp_path)
    try:
        c.start_scheduler(*SCHEDULER_FLAGS)
        w = c.start_worker("w-restart", *WORKER_FLAGS)
        with SplitserveClient(c.target, timeout=120) as client:
            client.wait_for_workers(1, timeout=240)
            first = client.generate("Hello", max_tokens=4, temperature=0.0, ignore_eos=True)
            # the worker restarts while idle
            w.signal(signal.SIGTERM)
            assert w.popen.wait(30) == 0
            deadline = time.monotonic() + 30
            while client.server_info().workers and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not client.server_info().workers
            c.start_worker("w-restart", *WORKER_FLAGS)
            client.wait_for_workers(1, timeout=240)
            again = client.generate("Hello", max_tokens=4, temperature=0.0, ignore_eos=True)
            assert again.token_ids == first.token_ids
        # the scheduler restarts: the (same) worker reconnects by itself
        c.scheduler.stop()
        c.start_scheduler(*SCHEDULER_FLAGS)
        with SplitserveClient(c.target, timeout=120) as client:
            client.wait_for_workers(1, timeout=60)
            third = client.generate("Hello", max_tokens=4, temperature=0.0, ignore_eos=True)
            assert third.token_ids == first.token_ids
    except BaseException:
        print(c.logs())
        raise
    finally:
        c.stop_all()
