"""Speculative decoding through real processes (scheduler + SmolLM2 workers over gRPC): greedy
output with prompt-lookup drafting equals greedy output without it, on the W64 prompts and on
repetitive ones (a passage quoted back, code edited), and a worker killed mid-speculation loses
no accepted token: the run with the kill gives the same tokens, each streamed once."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from common.client import SplitserveClient
from tests.e2e.conftest import WORKER_FLAGS
from tests.e2e.procs import Cluster, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

W64 = json.loads((Path(__file__).resolve().parents[2] / "bench/workloads/w64.json").read_text())
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "max_batch": 64}'
# the workers measure no step times: with max_batch set, every running request drafts (the
# measured draft budget would hold most of these wide batches back)
NO_BUDGET = ("--no-measure-costs",)
PASSAGE = (
    "The scheduler owns the request queues, the token budget and the KV block tables; each "
    "step it sends the workers a diff of what changed, and the workers send the sampled "
    "tokens back."
)
CODE = "def area(width, height):\n    return width * height\n\n\nprint(area(3, 4))\n"
REPETITIVE = [
    f"Repeat this passage word for word: {PASSAGE}",
    f"Quote the second half of this text exactly: {PASSAGE} {PASSAGE}",
    f"Rename `width` to `w` in this code and print the whole code:\n{CODE}",
    f"Add a docstring to this function and repeat the rest unchanged:\n{CODE}",
]


def run(client: SplitserveClient, jobs: list[dict], on_progress=None) -> dict[int, list[int]]:
    """Every job streamed at once; each job's token ids (each streamed token counted once)."""
    results: dict[int, list[int]] = {}
    counts = dict.fromkeys(range(len(jobs)), 0)

    def one(i: int) -> None:
        tokens: list[int] = []
        for msg in client.stream(temperature=0.0, ignore_eos=True, **jobs[i]):
            tokens.extend(msg.token_ids)
            counts[i] = len(tokens)
        results[i] = tokens

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    if on_progress is not None:
        on_progress(counts)
    for t in threads:
        t.join(600)
    return results


def serve(tmp_path, name: str, jobs: list[dict], spec: bool, workers=("w0",), during=None):
    c = Cluster(tmp_path / name)
    (tmp_path / name).mkdir()
    try:
        http = free_port()
        flags = ["--max-model-len", "1024", "--max-num-seqs", "64", "--worker-timeout", "10"]
        flags += ["--http-port", str(http)]
        c.start_scheduler(*flags, *(["--speculative-config", SPEC] if spec else []))
        procs = {
            w: c.start_worker(w, *WORKER_FLAGS, "--num-gpu-blocks", "512", *NO_BUDGET)
            for w in workers
        }
        with SplitserveClient(c.target, timeout=600) as client:
            client.wait_for_workers(len(workers), timeout=300)
            out = run(client, jobs, during(procs) if during else None)
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=30) as r:
            metrics = r.read().decode()
        return out, metrics
    except BaseException:
        print(c.logs())
        raise
    finally:
        c.stop_all()


def counter(metrics: str, name: str) -> float:
    """The sum of a counter over its label sets (workers)."""
    pattern = rf"^splitserve:{name}_total(?:{{[^}}]*}})? (\S+)$"
    return sum(float(v) for v in re.findall(pattern, metrics, re.M))


def test_greedy_with_speculation_equals_without(tmp_path):
    jobs = [{"token_ids": p, "max_tokens": 24} for p in W64["prompts"]]
    jobs += [{"messages": [{"role": "user", "content": p}], "max_tokens": 48} for p in REPETITIVE]
    off, metrics_off = serve(tmp_path, "off", jobs, spec=False)
    on, metrics = serve(tmp_path, "on", jobs, spec=True)
    assert len(on) == len(jobs)
    for i in range(len(jobs)):
        assert on[i] == off[i], i
    assert counter(metrics_off, "spec_decode_num_draft_tokens") == 0
    drafted = counter(metrics, "spec_decode_num_draft_tokens")
    accepted = counter(metrics, "spec_decode_num_accepted_tokens")
    assert drafted > 0 and 0 < accepted <= drafted
    per_pos = re.findall(
        r'^splitserve:spec_decode_num_accepted_tokens_per_pos_total{.*position="(\d+)".*} (\S+)$',
        metrics,
        re.M,
    )
    assert sum(float(v) for _, v in per_pos) == accepted


def test_a_worker_killed_mid_speculation_loses_no_accepted_token(tmp_path):
    jobs = [{"messages": [{"role": "user", "content": p}], "max_tokens": 64} for p in REPETITIVE]
    jobs *= 2
    reference, _ = serve(tmp_path, "ref", jobs, spec=False)

    def kill_mid_generation(procs):
        def watch(counts):
            deadline = time.monotonic() + 300
            while sum(counts.values()) < len(jobs) * 64 // 3:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            procs["w1"].signal(signal.SIGKILL)

        return watch

    got, _ = serve(
        tmp_path, "kill", jobs, spec=True, workers=("w0", "w1"), during=kill_mid_generation
    )
    for i in range(len(jobs)):
        assert got[i] == reference[i], i
