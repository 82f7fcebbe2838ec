"""Scheduler CPU overhead: microseconds per schedule() + update_from_output() in pure decode.

N requests decode (one token each per step) while W more wait in the queue and cannot be admitted
(max_num_seqs = N), so the cost of one step should grow with N only, and not with W.

Each configuration is measured twice: with CPython's default garbage-collector settings, and
"tuned" as a serving process would run (scheduler_svc.core.tune_gc_for_serving(): survivors of
setup frozen, gen0 threshold 50,000 allocations). A decode step
allocates ~4 small objects per request (the diff entry, the RequestOutput and their lists); with
a 700-allocation gen0 threshold and 1,000+ requests, those are still alive at collection time,
get promoted, and trigger full collections that walk the whole heap (blocks, waiting requests),
which is what makes the default column grow with the number of running requests once they are
many. Times are CPU time (time.process_time) of the benchmark process, best of --repeats.

    .venv/bin/python bench/scheduler_overhead.py                       # 64, 256, 1024 x 10,000
    .venv/bin/python bench/scheduler_overhead.py --running 256 --profile
    .venv/bin/python bench/scheduler_overhead.py --json bench/results/sched.json

Prints a table; --json writes the same rows as JSON. Never a timed test: numbers are noisy.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scheduler_svc.core import (  # noqa: E402
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    restore_gc,
    tune_gc_for_serving,
)

PROMPT = 32
BLOCK = 16


def build(num_running: int, num_waiting: int, steps: int) -> tuple[Scheduler, dict]:
    """A scheduler with num_running requests in decode and num_waiting stuck in the queue."""
    max_len = PROMPT + BLOCK + steps + 64  # nobody reaches it during the measured steps
    blocks_per_req = -(-max_len // BLOCK)
    cfg = SchedulerConfig(
        max_num_batched_tokens=max(4 * num_running, 2048),  # prefill everyone quickly
        max_num_seqs=num_running,
        block_size=BLOCK,
        num_blocks=num_running * blocks_per_req + 64,
        max_model_len=max_len,
        policy="fcfs",
    )
    s = Scheduler(cfg)
    params = SamplingParams(max_tokens=steps + 32, ignore_eos=True)
    for i in range(num_running):
        # prompt lengths spread over a block so block boundaries are crossed on different steps
        n = PROMPT + i % BLOCK
        s.add_request(Request(f"run-{i}", [(i * 7 + j) % 30000 + 1 for j in range(n)], params))
    # prefill until every request decodes
    while True:
        out = s.schedule()
        sampled = {}
        for rid in out.num_scheduled_tokens:
            r = s.get_request(rid)
            sampled[rid] = [5] if r.num_computed_tokens == r.num_tokens else []
        s.update_from_output(out, sampled)
        if len(s.running) == num_running and all(
            r.num_tokens - r.num_computed_tokens == 1 for r in s.running
        ):
            break
    for i in range(num_waiting):
        s.add_request(Request(f"wait-{i}", [(i + j) % 30000 + 1 for j in range(PROMPT)], params))
    sampled = {r.request_id: [7] for r in s.running}
    return s, sampled


@contextmanager
def gc_mode(mode: str):
    old = gc.get_threshold()
    gc.collect()
    if mode == "tuned":
        old = tune_gc_for_serving()
    elif mode == "off":
        gc.disable()
    try:
        yield
    finally:
        gc.enable()
        restore_gc(old)


def measure(num_running: int, num_waiting: int, steps: int, repeats: int, mode: str) -> dict:
    runs = []
    full_gcs = 0
    for _ in range(repeats):
        s, sampled = build(num_running, num_waiting, steps)
        schedule, update = s.schedule, s.update_from_output
        with gc_mode(mode):
            before = gc.get_stats()[2]["collections"]
            t0 = time.process_time()
            for _ in range(steps):
                out = schedule()
                update(out, sampled)
            elapsed = time.process_time() - t0
            full_gcs += gc.get_stats()[2]["collections"] - before
        assert out.total_num_scheduled_tokens == num_running, "not a pure decode step"
        assert len(s.waiting) == num_waiting
        runs.append(elapsed / steps)
    best = min(runs)
    return {
        "running": num_running,
        "waiting": num_waiting,
        "num_blocks": s.config.num_blocks,
        "gc": mode,
        "steps": steps,
        "us_per_step": best * 1e6,
        "us_per_step_median": statistics.median(runs) * 1e6,
        "us_per_request": best * 1e6 / num_running,
        "full_gc_per_100_steps": 100 * full_gcs / (steps * repeats),
    }


def profile(num_running: int, num_waiting: int, steps: int) -> None:
    s, sampled = build(num_running, num_waiting, steps)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        s.update_from_output(s.schedule(), sampled)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)


COLUMNS = (
    "running",
    "waiting",
    "gc",
    "µs/step",
    "µs/step median",
    "µs/request",
    "full GCs/100 steps",
)


def _cells(r: dict) -> list[str]:
    return [
        str(r["running"]),
        f"{r['waiting']:,}",
        r["gc"],
        f"{r['us_per_step']:.1f}",
        f"{r['us_per_step_median']:.1f}",
        f"{r['us_per_request']:.2f}",
        f"{r['full_gc_per_100_steps']:.1f}",
    ]


def print_table(rows: list[dict]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain fallback
        print("  ".join(f"{c:>14}" for c in COLUMNS))
        for r in rows:
            print("  ".join(f"{c:>14}" for c in _cells(r)))
        return
    table = Table(title="schedule() + update_from_output(), pure decode, CPU time")
    for col in COLUMNS:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(*_cells(r))
    Console().print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--waiting", type=int, nargs="+", default=[10_000])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--gc",
        nargs="+",
        default=["default", "tuned"],
        choices=["default", "tuned", "off"],
        help="garbage-collector settings",
    )
    ap.add_argument("--json", type=Path, help="write the rows as JSON to this path")
    ap.add_argument("--profile", action="store_true", help="cProfile the first configuration")
    args = ap.parse_args()
    if args.profile:
        profile(args.running[0], args.waiting[0], args.steps)
        return
    rows = [
        measure(n, w, args.steps, args.repeats, mode)
        for mode in args.gc
        for w in args.waiting
        for n in args.running
    ]
    print_table(rows)
    for mode in args.gc:
        for w in args.waiting:
            per_req = [r["us_per_request"] for r in rows if r["gc"] == mode and r["waiting"] == w]
            print(
                f"gc {mode}, {w:,} waiting: µs/request from {min(args.running)} to "
                f"{max(args.running)} running grows x{per_req[-1] / per_req[0]:.2f}"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"benchmark": "scheduler_overhead", "rows": rows}, indent=2)
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
