"""What moving the client APIs out of the scheduler process buys: one scheduler process, W
simulated workers (no model), and either the front-end inside the scheduler (`embedded`) or F
front-end processes in front of it (sharing one port). N client streams run for a while; the
table gives the tokens per second delivered to the clients and the CPU each process kind spent
per request-step (one token of one stream), the scheduler's being what limits how many streams
one scheduler sustains.

    python bench/frontend_scale.py --frontends 0 1 2 4 --streams 256 --json out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import psutil
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.client import SplitserveClient  # noqa: E402
from tests.e2e.procs import free_port  # noqa: E402

CLI = [sys.executable, "-m", "splitserve.cli"]


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [*CLI, *args], cwd=ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT
    )


def cpu(procs: list[subprocess.Popen]) -> float:
    total = 0.0
    for p in procs:
        times = psutil.Process(p.pid).cpu_times()
        total += times.user + times.system
    return total


def run_point(num_frontends: int, args, tmp: Path) -> dict:
    port, worker_port = free_port(), free_port()
    scheduler_port = free_port() if num_frontends else port
    procs: dict[str, list[subprocess.Popen]] = {"scheduler": [], "frontend": [], "worker": []}
    scheduler_args = [
        "scheduler",
        "--host",
        "127.0.0.1",
        "--port",
        str(scheduler_port),
        "--http-port",
        "0",
        "--worker-port",
        str(worker_port),
        "--max-num-seqs",
        str(args.streams),
        "--max-num-batched-tokens",
        "4096",
        "--log-level",
        "warning",
        # front-ends apart serve the clients; the FrontendLink is served only then
        *(["--no-client-api"] if num_frontends else []),
    ]
    procs["scheduler"].append(spawn(scheduler_args, tmp / f"scheduler-{num_frontends}.log"))
    for i in range(args.workers):
        worker_args = [
            "worker",
            "--scheduler",
            f"127.0.0.1:{worker_port}",
            "--worker-id",
            f"w{i}",
            "--simulate",
            "--sim-step-base-ms",
            str(args.step_ms),
            "--sim-num-blocks",
            "65536",
            "--log-level",
            "warning",
        ]
        procs["worker"].append(spawn(worker_args, tmp / f"worker-{num_frontends}-{i}.log"))
    for i in range(num_frontends):
        frontend_args = [
            "frontend",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--http-port",
            "0",
            "--scheduler",
            f"127.0.0.1:{worker_port}",
            "--frontend-id",
            f"fe{i}",
            "--log-level",
            "warning",
        ]
        procs["frontend"].append(spawn(frontend_args, tmp / f"frontend-{num_frontends}-{i}.log"))
    target = f"127.0.0.1:{port}"
    with SplitserveClient(target) as client:
        client.wait_for_workers(args.workers, timeout=120)
    received = [0]
    lock = threading.Lock()
    stop = threading.Event()

    def stream(i: int) -> None:
        with SplitserveClient(target, own_connection=True, timeout=600) as client:
            while not stop.is_set():
                try:
                    for msg in client.stream(
                        f"stream {i}", max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True
                    ):
                        with lock:
                            received[0] += len(msg.token_ids)
                        if stop.is_set():
                            break
                except grpc.RpcError:
                    if not stop.is_set():  # only the shutdown at the end may end a stream
                        raise

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(args.streams)]
    for t in threads:
        t.start()
    time.sleep(args.warmup)
    cpu0 = {kind: cpu(p) for kind, p in procs.items()}
    tokens0, t0 = received[0], time.monotonic()
    time.sleep(args.duration)
    cpu1 = {kind: cpu(p) for kind, p in procs.items()}
    tokens, elapsed = received[0] - tokens0, time.monotonic() - t0
    stop.set()
    for group in procs.values():
        for p in group:
            p.terminate()
    for group in procs.values():
        for p in group:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
    per_step = {k: 1e6 * (cpu1[k] - cpu0[k]) / max(1, tokens) for k in procs}
    return {
        "frontends": num_frontends or "embedded",
        "streams": args.streams,
        "tokens_per_s": round(tokens / elapsed, 1),
        "scheduler_cpu_us_per_request_step": round(per_step["scheduler"], 1),
        "frontend_cpu_us_per_request_step": round(per_step["frontend"], 1),
        "scheduler_cpu_util": round((cpu1["scheduler"] - cpu0["scheduler"]) / elapsed, 3),
        # what one core of scheduler CPU would carry at this step time (a token per step)
        "streams_per_scheduler_core": round(1e6 / per_step["scheduler"] * args.step_ms / 1e3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frontends", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=30.0)
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    tmp = Path(f"/tmp/frontend-scale-{int(time.time())}")
    tmp.mkdir(parents=True, exist_ok=True)
    rows = [run_point(f, args, tmp) for f in tqdm(args.frontends, desc="front-end counts")]
    table = Table(title=f"{args.streams} streams, {args.workers} simulated workers")
    for key in rows[0]:
        table.add_column(key)
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
