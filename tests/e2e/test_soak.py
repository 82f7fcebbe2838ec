"""Soak: a steady stream of requests while workers are killed (-9), frozen (SIGSTOP) past the
timeout, and frozen briefly (not past it). Nothing is lost or duplicated; every output equals
the fault-free one; block accounting is exact at the end.

SPLITSERVE_SOAK_SECONDS sets the duration (CI: 25 s; `make soak`: 600 s).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import grpc
import pytest

from common.client import SplitserveClient
from tests.e2e.procs import Cluster
from tests.e2e.test_many_workers import expected

pytestmark = [pytest.mark.e2e]
SOAK_SECONDS = float(os.environ.get("SPLITSERVE_SOAK_SECONDS", "25"))
WORKERS = ("soak0", "soak1", "soak2")
SIM = ("--simulate", "--sim-step-base-ms", "10", "--heartbeat-interval", "0.3")


def test_soak_with_faults(tmp_path):
    c = Cluster(tmp_path)
    rng = random.Random(1234)
    stats = {"requests": 0, "tokens": 0, "kills": 0, "long_freezes": 0, "short_freezes": 0}
    failures: list[str] = []
    stop = threading.Event()
    try:
        c.start_scheduler(
            "--worker-timeout",
            "1.5",
            "--max-migrations",
            "20",
            "--worker-wait-timeout",
            "60",
            "--max-num-seqs",
            "32",
        )
        procs = {w: c.start_worker(w, *SIM) for w in WORKERS}
        client = SplitserveClient(c.target, timeout=180)
        client.wait_for_workers(len(WORKERS), timeout=60)
        lock = threading.Lock()

        def requester(seed: int) -> None:
            r = random.Random(seed)
            while not stop.is_set():
                prompt = [r.randrange(3, 49152) for _ in range(r.randrange(4, 120))]
                max_tokens = r.randrange(4, 64)
                tokens: list[int] = []
                finish = None
                try:
                    for msg in client.stream(
                        token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
                    ):
                        tokens.extend(msg.token_ids)
                        finish = msg.finish_reason or finish
                except grpc.RpcError as exc:
                    failures.append(f"{exc.code().name}: {exc.details()}")
                    continue
                if finish != 2 or tokens != expected(prompt, max_tokens):
                    failures.append(f"wrong output (finish {finish}, {len(tokens)} tokens)")
                with lock:
                    stats["requests"] += 1
                    stats["tokens"] += len(tokens)

        def chaos() -> None:
            while not stop.wait(rng.uniform(1.0, 2.5)):
                victim = rng.choice(WORKERS)
                action = rng.choice(["kill", "long_freeze", "short_freeze"])
                proc = procs[victim]
                if action == "kill":
                    proc.signal(signal.SIGKILL)
                    proc.popen.wait()
                    stats["kills"] += 1
                    time.sleep(rng.uniform(0.2, 1.0))
                    procs[victim] = c.start_worker(victim, *SIM)
                elif action == "long_freeze":  # past the timeout: declared lost, then returns
                    proc.signal(signal.SIGSTOP)
                    time.sleep(rng.uniform(2.0, 3.0))
                    proc.signal(signal.SIGCONT)
                    stats["long_freezes"] += 1
                else:  # shorter than the timeout: must not be declared lost
                    proc.signal(signal.SIGSTOP)
                    time.sleep(0.3)
                    proc.signal(signal.SIGCONT)
                    stats["short_freezes"] += 1

        threads = [threading.Thread(target=requester, args=(i,)) for i in range(12)]
        threads.append(threading.Thread(target=chaos))
        for t in threads:
            t.start()
        time.sleep(SOAK_SECONDS)
        stop.set()
        for t in threads:
            t.join(240)
        assert not any(t.is_alive() for t in threads), "a stream hung"
        for proc in procs.values():
            proc.signal(signal.SIGCONT)
        print(f"soak {SOAK_SECONDS:.0f} s: {stats}, failures {len(failures)}")
        assert not failures, failures[:5]
        assert stats["requests"] > 20
        client.wait_for_workers(len(WORKERS), timeout=60)
        deadline = time.monotonic() + 20
        while True:
            info = client.server_info()
            if (
                info.num_requests_in_flight == 0
                and len(info.workers) == len(WORKERS)
                and all(
                    w.num_free_blocks == w.num_blocks and w.num_running == 0 for w in info.workers
                )
            ):
                break
            assert time.monotonic() < deadline, f"accounting not exact at the end: {info}"
            time.sleep(0.1)
        client.close()
    except BaseException:
        print(c.logs())
        raise
    finally:
        stop.set()
        c.stop_all()
