"""How many workers can one scheduler drive? The real scheduler service (in this process)
against N simulated worker processes (no model: each step answers after a modelled forward
time) with R running requests each. Reports steps/s, the scheduler's CPU use, and the time it
adds to each step: the worker's idle gap between sending a result and receiving its next step.

    .venv/bin/python bench/scale_sim.py --workers 1 4 16 64 --running 256 --json out.json
    # exposed overhead with the real model at batch 64, async vs synchronous scheduling:
    .venv/bin/python bench/scale_sim.py --real --workers 1 --running 64 --max-tokens 400
    .venv/bin/python bench/scale_sim.py --real --workers 1 --running 64 --max-tokens 400 --no-async
    .venv/bin/python bench/scale_sim.py --real --workers 1 --running 64 --max-tokens 400 \
        --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import event_loop  # noqa: E402
from common.logging import configure_logging  # noqa: E402
from scheduler_svc.config import SchedulerServiceConfig  # noqa: E402
from scheduler_svc.core import (  # noqa: E402
    SamplingParams,
    restore_gc,
    tune_gc_for_serving,
)
from splitserve.scheduler_process import SchedulerServer  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NoDetokenizer:
    """Stands in for the detokenizer when --skip-detokenize (clients that want token ids)."""

    stop_hit = None

    def add_tokens(self, ids):
        pass

    def take_delta(self, final):
        return ""

    def push(self, ids, final):
        return ""


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def children_cpu_seconds(procs) -> float | None:
    """CPU time of the running worker processes (Linux /proc; None elsewhere): pinned to the
    scheduler's core (taskset), the workers take their share of it."""
    total = 0.0
    try:
        for p in procs:
            fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    except (OSError, IndexError, ValueError):
        return None
    return total / os.sysconf("SC_CLK_TCK")


async def drain(state) -> None:
    while True:
        delta = await state.queue.get()
        if delta.finish_reason is not None:
            return


async def run_point(n_workers: int, args, progress) -> dict:
    cfg = SchedulerServiceConfig(
        host="127.0.0.1",
        port=free_port(),
        worker_port=free_port(),
        http_port=0,
        max_num_seqs=args.running,
        max_num_batched_tokens=args.budget,
        max_model_len=8192,
        worker_queue_depth=args.running,
        log_level="warning",
        async_scheduling=not args.no_async,
        stream_interval=args.stream_interval,
        speculative_config=args.speculative_config,
    )
    server = SchedulerServer(cfg)
    await server.start()
    # as `splitserve scheduler` does (splitserve/scheduler_process.py serve()): without it, full
    # collections over every live request stall the step loop now and then
    gc_before = None if args.default_gc else tune_gc_for_serving()
    procs = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for i in range(n_workers):
        if args.real:  # the real model (SmolLM2) instead of the simulation
            worker_args = [
                "--num-gpu-blocks",
                str(args.running * 16),
                "--num-threads",
                str(max(1, (os.cpu_count() or 1) // n_workers)),
                "--dtype",
                args.dtype,
            ]
        else:
            worker_args = [
                "--simulate",
                "--sim-step-base-ms",
                str(args.step_ms),
                "--sim-step-per-token-us",
                str(args.per_token_us),
                "--sim-num-blocks",
                str(args.running * 40),
            ]
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "splitserve.cli",
                    "worker",
                    *worker_args,
                    "--scheduler",
                    f"127.0.0.1:{cfg.worker_port}",
                    "--worker-id",
                    f"w{i}",
                    "--log-level",
                    "warning",
                ],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    engine = server.engine
    try:
        deadline = time.monotonic() + 120
        while len(engine.sessions) < n_workers:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(engine.sessions)} of {n_workers} workers attached")
            await asyncio.sleep(0.1)
        rng = random.Random(0)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        tasks = []
        for i in range(n_workers * args.running):
            prompt = [rng.randrange(3, 49152) for _ in range(args.prompt_len)]
            if args.repetitive:
                prompt = (prompt[:8] * args.prompt_len)[: args.prompt_len]
            state = server.intake.make_state(f"r{i}", prompt, params, [])
            if args.skip_detokenize:
                state.detokenizer = NoDetokenizer()
            engine.submit(state)
            tasks.append(asyncio.create_task(drain(state)))
        # warm up until every request decodes
        while sum(s.scheduler.stats().num_running for s in engine.sessions.values()) < len(tasks):
            await asyncio.sleep(0.1)
        await asyncio.sleep(args.warmup)
        sessions = list(engine.sessions.values())
        before = [(s.num_steps, s.total_worker_idle_s, s.total_worker_step_s) for s in sessions]
        cpu0, wcpu0, t0 = cpu_seconds(), children_cpu_seconds(procs), time.perf_counter()
        await asyncio.sleep(args.duration)
        cpu1, wcpu1, t1 = cpu_seconds(), children_cpu_seconds(procs), time.perf_counter()
        after = [(s.num_steps, s.total_worker_idle_s, s.total_worker_step_s) for s in sessions]
        steps = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
        drafting = [s.scheduler.stats() for s in sessions]
        lookups = sum(st.num_spec_lookups for st in drafting)
        idle = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
        busy = sum(a[2] - b[2] for a, b in zip(after, before, strict=True))
        for state in list(engine.requests.values()):
            engine.abort(state.request_id)
        await asyncio.gather(*tasks)
        wall = t1 - t0
        result = {
            "workers": n_workers,
            "running_per_worker": args.running,
            "steps_per_s": steps / wall,
            "steps_per_s_per_worker": steps / wall / n_workers,
            "tokens_per_s": steps / wall * args.running,
            "scheduler_cpu_pct": 100 * (cpu1 - cpu0) / wall,
            "workers_cpu_pct": (
                None if wcpu0 is None or wcpu1 is None else 100 * (wcpu1 - wcpu0) / wall
            ),
            # scheduler CPU per request per step, and the request-steps one core of it sustains
            "sched_us_per_request_step": 1e6 * (cpu1 - cpu0) / max(steps * args.running, 1),
            "request_steps_per_core_s": steps * args.running / max(cpu1 - cpu0, 1e-9),
            "added_ms_per_step": 1e3 * idle / max(steps, 1),
            "worker_step_ms": 1e3 * busy / max(steps, 1),
            "added_share_pct": 100 * idle / max(idle + busy, 1e-9),
            "detokenize": not args.skip_detokenize,
            "async_scheduling": not args.no_async,
            "real_model": args.real,
            "dtype": args.dtype if args.real else None,
            "tuned_gc": not args.default_gc,
            "event_loop": event_loop.loop_name(),
            "stream_interval": args.stream_interval,
            "stream_interval_reached": engine.pacer.interval,  # where an adaptive one settled
            # --speculative-config: the scheduler's drafting (whole run) per lookup
            "draft_us_per_lookup": 1e6 * sum(st.spec_draft_time_s for st in drafting) / lookups
            if lookups
            else None,
            "spec_lookups": lookups,
        }
        progress(result)
        return result
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        await server.stop(0.5)
        if gc_before is not None:
            restore_gc(gc_before)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--running", type=int, default=256, help="running requests per worker")
    parser.add_argument("--step-ms", type=float, default=30.0, help="modelled forward time")
    parser.add_argument("--per-token-us", type=float, default=0.0)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--budget", type=int, default=4096, help="max_num_batched_tokens")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument(
        "--skip-detokenize", action="store_true", help="token-id clients: no text deltas"
    )
    parser.add_argument("--no-async", action="store_true", help="synchronous scheduling")
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=0,
        help="the service's --stream-interval (0 = adaptive; the table shows where it settled)",
    )
    parser.add_argument(
        "--default-gc",
        action="store_true",
        help="keep CPython's GC settings (the service tunes them at start)",
    )
    parser.add_argument(
        "--real", action="store_true", help="real SmolLM2 workers instead of simulated ones"
    )
    parser.add_argument("--max-tokens", type=int, default=6000)
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the real workers' dtype (with --real)",
    )
    parser.add_argument(
        "--event-loop",
        choices=event_loop.EVENT_LOOPS,
        default="auto",
        help="the scheduler's loop (the service's --event-loop)",
    )
    parser.add_argument(
        "--speculative-config",
        default="",
        help="the scheduler's --speculative-config (drafting cost per lookup in the JSON and "
        "table; set max_batch above --running for it to draft)",
    )
    parser.add_argument(
        "--repetitive",
        action="store_true",
        help="prompts of one short phrase repeated (prompt lookup finds matches)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    configure_logging("warning", json_logs=True)
    console = Console()
    results = []
    for n in args.workers:
        console.print(f"[bold]{n} simulated worker(s) x {args.running} running...[/bold]")
        results.append(event_loop.run(run_point(n, args, lambda r: None), args.event_loop))
    table = Table(
        title=f"scheduler driving simulated workers ({args.step_ms:g} ms modelled "
        f"step, {'with' if not args.skip_detokenize else 'without'} detokenize, "
        f"{results[0]['event_loop'] if results else args.event_loop} loop, "
        f"stream interval {args.stream_interval})"
    )
    for col in (
        "workers",
        "running",
        "steps/s",
        "steps/s/worker",
        "tokens/s",
        "sched CPU %",
        "workers CPU %",
        "µs/request-step",
        "added ms/step",
        "worker ms/step",
        "added share %",
        "interval",
        "draft µs/lookup",
    ):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            str(r["workers"]),
            str(r["workers"] * r["running_per_worker"]),
            f"{r['steps_per_s']:.1f}",
            f"{r['steps_per_s_per_worker']:.1f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['scheduler_cpu_pct']:.0f}",
            "-" if r["workers_cpu_pct"] is None else f"{r['workers_cpu_pct']:.0f}",
            f"{r['sched_us_per_request_step']:.1f}",
            f"{r['added_ms_per_step']:.2f}",
            f"{r['worker_step_ms']:.2f}",
            f"{r['added_share_pct']:.1f}",
            str(r["stream_interval_reached"]),
            "-" if r["draft_us_per_lookup"] is None else f"{r['draft_us_per_lookup']:.1f}",
        )
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
