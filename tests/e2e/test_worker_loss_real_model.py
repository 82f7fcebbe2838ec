"""kill -9 a SmolLM2 worker mid-generation: every request still finishes, with the text of the
run without failure (greedy), each token streamed once."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from common.client import SplitserveClient
from tests.e2e.conftest import WORKER_FLAGS
from tests.e2e.procs import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = [f"Write one sentence about the number {i}." for i in range(9)]
MAX_TOKENS = 24


def run_all(client: SplitserveClient, on_progress=None) -> dict[int, tuple[str, list[int], set]]:
    results: dict[int, tuple[str, list[int], set]] = {}
    counts = {i: 0 for i in range(len(PROMPTS))}

    def one(i: int) -> None:
        text, tokens, workers = [], [], set()
        for msg in client.stream(
            messages=[{"role": "user", "content": PROMPTS[i]}],
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            ignore_eos=True,
        ):
            text.append(msg.text)
            tokens.extend(msg.token_ids)
            counts[i] = len(tokens)
            if msg.worker_id:
                workers.add(msg.worker_id)
        results[i] = ("".join(text), tokens, workers)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    if on_progress is not None:
        on_progress(counts)
    for t in threads:
        t.join(600)
    return results


def test_kill_9_real_worker_keeps_every_request_and_its_text(tmp_path):
    c = Cluster(tmp_path)
    try:
        c.start_scheduler(
            "--max-model-len",
            "1024",
            "--max-num-seqs",
            "4",
            "--worker-queue-depth",
            "1",
            "--worker-timeout",
            "10",
        )
        procs = {w: c.start_worker(w, *WORKER_FLAGS) for w in ("m0", "m1", "m2")}
        with SplitserveClient(c.target, timeout=600) as client:
            client.wait_for_workers(3, timeout=300)
            reference = run_all(client)

            def kill_mid_generation(counts):
                deadline = time.monotonic() + 300
                while sum(counts.values()) < len(PROMPTS) * MAX_TOKENS // 4:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                procs["m1"].signal(signal.SIGKILL)

            with_failure = run_all(client, kill_mid_generation)
        assert len(with_failure) == len(PROMPTS)
        for i in range(len(PROMPTS)):
            ref_text, ref_tokens, _ = reference[i]
            text, tokens, _ = with_failure[i]
            assert len(tokens) == MAX_TOKENS
            assert tokens == ref_tokens, f"prompt {i}: tokens differ after the worker died"
            assert text == ref_text
        moved = [i for i, (_, _, ws) in with_failure.items() if "m1" in ws and len(ws) > 1]
        assert moved, "no request was running on the killed worker"
    except BaseException:
        print(c.logs())
        raise
    finally:
        c.stop_all()
