"""What authenticated internal links cost: W64 through plaintext links and through the cluster's
mutual TLS, side by side.

    .venv/bin/python bench/link_auth.py                      # 6 turns each, ~4 min on 2 cores
    .venv/bin/python bench/link_auth.py --turns 2 --json link_auth.json

Each setting is a `splitserve scheduler --no-client-api` + one `splitserve frontend` + one
`splitserve worker` (the real model), all on loopback, so that both internal links carry every
request: front-end -> leader (FrontendLink) and leader -> worker (WorkerLink). "plain" runs
them without credentials (plaintext, allowed on loopback only); "mtls" with the cluster's
credentials as `splitserve up` makes them (common/credentials.py). Both settings are up at
once and take turns, alternating, so that the machine's drift affects both alike; a turn is the
64 W64 prompts, all 64 at once, 64 greedy tokens each, EOS ignored. Reported per setting:
out tok/s over all turns, TPOT p50, and the scheduler's step latency (its step-time histogram:
schedule to the worker's answer applied) from the leader's /metrics; then mtls ÷ plain.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from peers_lib.servers import Process, free_port, wait_until  # noqa: E402
from speculative import closed_loop, counter  # noqa: E402

from common import event_loop  # noqa: E402
from common.credentials import create_cluster  # noqa: E402

console = Console(stderr=True)
SETTINGS = ("plain", "mtls")


class Setting:
    """A leader, a front-end and a worker; with `credentials`, every link is mutual TLS."""

    def __init__(self, name: str, credentials: Path | None, args, log_dir: Path) -> None:
        cli = [sys.executable, "-m", "splitserve.cli"]
        self.name = name
        self.port, self.http, wport = free_port(), free_port(), free_port()

        def role(r: str) -> list[str]:
            return ["--credentials", str(credentials / r)] if credentials else []

        common = ["--log-level", "WARNING"]
        scheduler = ["scheduler", "--host", "127.0.0.1", "--port", str(free_port())]
        scheduler += ["--worker-port", str(wport), "--http-port", str(self.http)]
        scheduler += ["--no-client-api", "--max-num-seqs", "64", *role("scheduler"), *common]
        frontend = ["frontend", "--host", "127.0.0.1", "--port", str(self.port)]
        frontend += ["--http-port", "0", "--scheduler", f"127.0.0.1:{wport}"]
        frontend += ["--frontend-id", f"fe-{name}", *role("frontend"), *common]
        worker = ["worker", "--scheduler", f"127.0.0.1:{wport}", "--worker-id", f"w-{name}"]
        worker += ["--num-threads", str(args.threads), *role("worker"), *common]
        self.procs = [
            Process(f"scheduler-{name}", cli + scheduler, log_dir),
            Process(f"frontend-{name}", cli + frontend, log_dir),
            Process(f"worker-{name}", cli + worker, log_dir),
        ]
        wait_until(lambda: f"w-{name}" in self.metrics(), self.procs[2], 600, "worker attached")

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/metrics", timeout=10) as r:
            return r.read().decode()

    def turn(self, prompts: list[list[int]], max_tokens: int) -> dict:
        before = self.metrics()
        results, seconds = event_loop.run(
            closed_loop(f"127.0.0.1:{self.port}", prompts, len(prompts), max_tokens)
        )
        after = self.metrics()
        failed = [r.error for r in results if not r.ok]
        if failed:
            raise RuntimeError(f"{self.name}: {len(failed)} requests failed: {failed[0]}")
        steps = counter(after, "scheduler_steps") - counter(before, "scheduler_steps")
        step_s = counter(after, "step_time_seconds") - counter(before, "step_time_seconds")
        return {
            "tokens": sum(r.output_len for r in results),
            "seconds": seconds,
            "tpots": [r.tpot for r in results if r.tpot is not None],
            "steps": steps,
            "step_seconds": step_s,
        }

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def summarize(turns: list[dict]) -> dict:
    seconds = sum(t["seconds"] for t in turns)
    steps = sum(t["steps"] for t in turns)
    return {
        "turns": len(turns),
        "tokens": sum(t["tokens"] for t in turns),
        "seconds": seconds,
        "out_tok_s": sum(t["tokens"] for t in turns) / seconds,
        "tpot_p50_ms": 1e3 * statistics.median([x for t in turns for x in t["tpots"]]),
        "steps": steps,
        "step_ms": 1e3 * sum(t["step_seconds"] for t in turns) / steps if steps else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--turns", type=int, default=6, help="turns of each setting")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="the worker's torch threads")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--log-dir", type=Path, default=None)
    args = p.parse_args()
    prompts = json.loads((ROOT / "bench/workloads/w64.json").read_text())["prompts"]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="splitserve-link-auth-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    credentials = create_cluster(log_dir / "credentials")
    settings: dict[str, Setting] = {}
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    try:
        for name in SETTINGS:
            settings[name] = Setting(name, credentials if name == "mtls" else None, args, log_dir)
        for setting in settings.values():  # set-up paid outside the measured turns
            setting.turn(prompts[:8], 8)
        with Progress(console=console) as progress:
            task = progress.add_task("turns", total=args.turns * len(SETTINGS))
            for turn in range(args.turns):
                order = SETTINGS if turn % 2 == 0 else SETTINGS[::-1]
                for name in order:
                    runs[name].append(settings[name].turn(prompts, args.max_tokens))
                    progress.advance(task)
    finally:
        for setting in settings.values():
            setting.stop()
    rows = {name: summarize(turns) for name, turns in runs.items()}
    ratios = [
        (m["tokens"] / m["seconds"]) / (p_["tokens"] / p_["seconds"])
        for p_, m in zip(runs["plain"], runs["mtls"], strict=True)
    ]
    table = Table(title="W64 (64 streams, 64 tokens) through plaintext and mutual-TLS links")
    for col in ("links", "out tok/s", "TPOT p50 (ms)", "step (ms)", "steps"):
        table.add_column(col)
    for name, r in rows.items():
        step = f"{r['step_ms']:.2f}" if r["step_ms"] is not None else "-"
        table.add_row(
            name, f"{r['out_tok_s']:.1f}", f"{r['tpot_p50_ms']:.1f}", step, str(int(r["steps"]))
        )
    Console(width=160).print(table)
    plain, mtls = rows["plain"], rows["mtls"]
    summary = {
        "throughput_ratio": mtls["out_tok_s"] / plain["out_tok_s"],
        "step_ratio": (mtls["step_ms"] / plain["step_ms"])
        if mtls["step_ms"] and plain["step_ms"]
        else None,
        "turn_ratios": ratios,
    }
    turn_ratios = " / ".join(
        f"{x:.3f}" for x in (min(ratios), statistics.median(ratios), max(ratios))
    )
    console.print(
        f"mtls ÷ plain: throughput {summary['throughput_ratio']:.3f}, step latency "
        f"{summary['step_ratio'] or float('nan'):.3f}; turns' throughput ratios (min / median / "
        f"max) {turn_ratios}"
    )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, **summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
