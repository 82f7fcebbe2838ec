"""The first requests of `splitserve up --schedulers 2 --frontends 2`, sent from the moment the
public port opens and before any worker exists (issue #35, problem 7: one of them was never
dispatched nor timed out). Each reaches the leader whenever its front-end's link comes up,
waits for a worker, and runs on the first ones to attach. The workers are simulated and
started by hand once the control plane is up."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time

import grpc
import psutil
import pytest

from common.client import SplitserveClient
from common.model_source import read_vocab_size, resolve_model
from tests.e2e.ha_cluster import cluster_body, ha_up_argv, worker_argv
from tests.e2e.procs import ROOT, free_port, interrupt
from worker_svc.sim_runner import sim_next_token

pytestmark = [pytest.mark.e2e]

NUM_REQUESTS = 40
MAX_TOKENS = 4


def sim_reference(prompt: list[int]) -> list[int]:
    seq = list(prompt)
    for _ in range(MAX_TOKENS):
        seq.append(sim_next_token(seq, read_vocab_size(resolve_model(None))))
    return seq[len(prompt) :]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def stop(popen: subprocess.Popen) -> None:
    children = []
    with contextlib.suppress(psutil.Error):
        children = psutil.Process(popen.pid).children()
    if popen.poll() is None:
        interrupt(popen, 30)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()


def test_requests_sent_before_any_worker_run_on_the_first_workers(tmp_path):
    port, http_port, etcd_port = free_port(), free_port(), free_port()
    state_dir = tmp_path / "state"
    argv = ha_up_argv(
        port,
        http_port,
        *("--worker-wait-timeout", "120", "--state-dir", str(state_dir)),
        workers=0,
        etcd_port=etcd_port,
    )
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        up = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    workers: list[subprocess.Popen] = []
    results: list = [None] * NUM_REQUESTS

    def one(i: int) -> None:
        try:
            with SplitserveClient(f"127.0.0.1:{port}", timeout=150) as client:
                results[i] = client.generate(
                    token_ids=[11, 12, 13, i],
                    max_tokens=MAX_TOKENS,
                    ignore_eos=True,
                    temperature=0.0,
                )
        except grpc.RpcError as exc:
            results[i] = exc

    try:
        deadline = time.monotonic() + 120
        while not port_open(port):  # the first front-end is up: its link is only starting
            assert up.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.002)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(NUM_REQUESTS)]
        for thread in threads:  # over the front-ends' first moments with the leader
            thread.start()
            time.sleep(0.01)
        while not ((body := cluster_body(http_port)) and len(body["frontends"]) == 2):
            assert up.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        for i in range(2):
            argv = worker_argv(etcd_port, state_dir, f"late-{i}", "--simulate")
            with open(tmp_path / f"late-{i}.log", "wb") as log:
                workers.append(
                    subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
                )
        for thread in threads:
            thread.join(200)
        for i, result in enumerate(results):
            assert not isinstance(result, grpc.RpcError), f"request {i}: {result}"
            assert result.finish_reason == "length"
            assert result.token_ids == sim_reference([11, 12, 13, i])
            assert result.worker_ids[-1].startswith("late-")
    except BaseException:
        print(log_path.read_text()[-8000:])
        raise
    finally:
        for worker in workers:
            stop(worker)
        stop(up)
