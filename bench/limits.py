"""One large body (issue #35): what a hostile request costs the others. Starts `splitserve up`
on loopback (one worker, the front-end inside the scheduler), streams a completion and, once
tokens flow, sends the attack; the table gives the time to its 4xx, the other stream's longest
gap between tokens (beside that of the same stream alone), and the scheduler's RSS before,
at its peak and after.

Attacks: a 21 MB /v1/completions body (over --max-request-bytes: 413 before it is read), a
3.9 MB chat body under the cap whose text is far over --max-model-len (400 before it is
tokenized), and a body just under the cap of 120,000 one-letter messages (the most JSON objects
a body can carry: parsed and validated on the event loop, rendered beside it). The worker is
simulated (no model; the scheduler still loads and runs the real tokenizer, which is what is
measured) unless --real-model.

    python bench/limits.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.procs import free_port  # noqa: E402

CLI = [sys.executable, "-m", "splitserve.cli"]
MB = 1e6
ATTACKS = {
    "21 MB completion": ("/v1/completions", {"prompt": "x" * 21_000_000, "max_tokens": 4}),
    "3.9 MB chat over max_model_len": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "word " * 780_000}], "max_tokens": 4},
    ),
    "4 MB chat of 120k messages": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}] * 120_000, "max_tokens": 4},
    ),
}


class RssSampler:
    """The process's resident set, sampled every few milliseconds on a thread of its own."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        return self.process.memory_info().rss

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.now())

    def __enter__(self) -> RssSampler:
        self.peak = self.now()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class Stream:
    """A streamed completion on a thread; the arrival time of each chunk."""

    def __init__(self, base: str, max_tokens: int) -> None:
        self.base = base
        self.max_tokens = max_tokens
        self.arrivals: list[float] = []
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        body = {
            "prompt": "The capital of France is",
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        url = self.base + "/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    self.arrivals.append(time.perf_counter())
                    if len(self.arrivals) >= 5:
                        self.started.set()

    def longest_gap(self) -> float:
        self._thread.join()
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]
        return max(gaps, default=0.0)


def start_cluster(args, tmp: Path) -> tuple[subprocess.Popen, str]:
    http_port = free_port()
    argv = [
        *CLI,
        "up",
        "--workers",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        "--worker-port",
        str(free_port()),
        "--http-port",
        str(http_port),
        "--state-dir",
        str(tmp / "state"),
        "--max-model-len",
        str(args.max_model_len),
    ]
    if not args.real_model:
        argv += ["--worker-arg=--simulate", f"--worker-arg=--sim-step-base-ms={args.step_ms}"]
    up = subprocess.Popen(
        argv, cwd=ROOT, stdout=open(tmp / "up.log", "wb"), stderr=subprocess.STDOUT
    )
    base = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(base + "/ready", timeout=2).status_code == 200:
                return up, base
        except httpx.HTTPError:
            pass
        if up.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the cluster did not get ready; see {tmp / 'up.log'}")
        time.sleep(0.2)


def scheduler_pid(up: subprocess.Popen) -> int:
    for child in psutil.Process(up.pid).children(recursive=True):
        if "scheduler" in child.cmdline():
            return child.pid
    raise SystemExit("no scheduler process under `splitserve up`")


def run_attack(name: str, base: str, pid: int, args) -> dict:
    path, payload = ATTACKS[name]
    body = json.dumps(payload).encode()
    rss = psutil.Process(pid)
    before = rss.memory_info().rss
    with RssSampler(pid) as sampler:
        stream = Stream(base, args.max_tokens)
        if not stream.started.wait(120):
            raise SystemExit("the other stream never started")
        start = time.perf_counter()
        r = httpx.post(
            base + path, content=body, headers={"Content-Type": "application/json"}, timeout=120
        )
        to_answer = time.perf_counter() - start
        gap = stream.longest_gap()
        time.sleep(args.settle)
    return {
        "attack": name,
        "body_mb": round(len(body) / MB, 1),
        "status": r.status_code,
        "to_4xx_s": round(to_answer, 3),
        "other_stream_longest_gap_s": round(gap, 3),
        "rss_before_mb": round(before / MB, 1),
        "rss_peak_mb": round(sampler.peak / MB, 1),
        "rss_after_mb": round(rss.memory_info().rss / MB, 1),
        "rss_growth_mb": round((sampler.peak - before) / MB, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real-model", action="store_true", help="SmolLM2 on the worker")
    parser.add_argument("--step-ms", type=float, default=20.0, help="simulated step time")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=200, help="the other stream's length")
    parser.add_argument("--rounds", type=int, default=3, help="times each attack is sent")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds before 'after' RSS")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-limits-") as tmp:
        up, base = start_cluster(args, Path(tmp))
        try:
            pid = scheduler_pid(up)
            quiet = Stream(base, args.max_tokens).longest_gap()  # also warms the server up
            rows = [
                run_attack(name, base, pid, args) for _ in range(args.rounds) for name in ATTACKS
            ]
        finally:
            up.terminate()
            up.wait(60)
    worker = "SmolLM2-135M" if args.real_model else f"simulated, {args.step_ms:g} ms steps"
    table = Table(
        title=f"One large body: worker {worker}; a quiet stream's longest gap {quiet:.3f} s"
    )
    for key in rows[0]:
        table.add_column(key)
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    Console(width=200).print(table)
    if args.json:
        result = {"worker": worker, "quiet_stream_longest_gap_s": round(quiet, 3), "rows": rows}
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
