"""Speculative decoding (prompt lookup) off and on, side by side, over gRPC.

    .venv/bin/python bench/speculative.py                       # the full table, ~13 min on 2 cores
    .venv/bin/python bench/speculative.py --concurrency 1,4 --workloads repetitive --quick
    .venv/bin/python bench/speculative.py --json spec.json --plot docs/speculative.png

Each setting (off, and on with --spec) is one `splitserve scheduler` + one `splitserve worker`
process pair, both started at once. For each workload and concurrency c, off and on take
--turns turns each, alternating, so that the machine's drift affects both alike; in a turn c
streams run at once (closed loop: a stream sends its next request when its last one ends) over
max(--waves x c, --turn-requests) requests, the next prompts of the workload each turn (both
settings the same ones); greedy, EOS ignored. A row adds its turns up: out tok/s over all of
them, and the spread of the turns' own on/off ratios. Workloads:
- repetitive: chat prompts that ask SmolLM2 to quote its input (passages of bench/data/essays.txt)
  or to edit code and print it whole (snippets of this repository);
- w64: the W64 prompts (bench/workloads/w64.json).
Printed per row: out tok/s, TPOT p50, acceptance (accepted / drafted tokens, from the
scheduler's spec_decode counters), the drafting share of the step (the scheduler's drafting
seconds over the worker steps' seconds) and the on/off speed ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from peers_lib.servers import Process, free_port, wait_until  # noqa: E402

from common import event_loop  # noqa: E402
from splitserve.loadgen import BenchRequest, GrpcBackend  # noqa: E402

DEFAULT_SPEC = '{"method": "ngram"}'
console = Console(stderr=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", default="1,4,16,64", help="comma list of concurrent streams")
    p.add_argument("--workloads", default="repetitive,w64", help="comma list: repetitive, w64")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--turn-requests", type=int, default=4, help="requests per turn at least")
    p.add_argument("--waves", type=int, default=2, help="a turn: at least this many x c requests")
    p.add_argument("--spec", default=DEFAULT_SPEC, help="--speculative-config for the 'on' runs")
    p.add_argument("--threads", type=int, default=2, help="the worker's torch threads")
    p.add_argument("--turns", type=int, default=6, help="turns of each setting per row")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quick", action="store_true", help="fewer tokens and requests")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="PNG: out tok/s off vs on")
    p.add_argument("--log-dir", type=Path, default=None)
    args = p.parse_args()
    if args.quick:
        args.max_tokens, args.turns = 32, 2
    return args


# ---- workloads ------------------------------------------------------------------------------
CODE_FILES = ("common/messages.py", "scheduler_svc/core/request.py", "worker_svc/kv_cache.py")


def repetitive_prompts(tokenizer, n: int = 16) -> list[list[int]]:
    """Chat prompts whose answers quote their input: passages to repeat, code to edit whole."""
    text = (ROOT / "bench/data/essays.txt").read_text()
    paragraphs = [p.strip() for p in text.split("\n\n") if 200 < len(p.strip()) < 900]
    snippets = []
    for name in CODE_FILES:
        lines = (ROOT / name).read_text().splitlines()
        for start in range(20, len(lines) - 12, 25):
            snippets.append("\n".join(lines[start : start + 12]))
    asks = []
    for i in range(n):
        if i % 2 == 0:
            passage = paragraphs[(i // 2) % len(paragraphs)]
            asks.append(f"Repeat the following text exactly, word for word:\n\n{passage}")
        else:
            code = snippets[(i // 2) % len(snippets)]
            asks.append(
                "Add a comment line at the top of this code and then print the whole code "
                f"unchanged:\n\n```python\n{code}\n```"
            )
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": a}], add_generation_prompt=True)
        for a in asks
    ]


def load_prompts(name: str) -> list[list[int]]:
    if name == "w64":
        return json.loads((ROOT / "bench/workloads/w64.json").read_text())["prompts"]
    from common.model_source import resolve_model
    from common.tokenizer import load_tokenizer

    return repetitive_prompts(load_tokenizer(resolve_model(None)))


# ---- one setting: a scheduler + a worker ----------------------------------------------------
class Server:
    def __init__(self, args, spec: str | None, log_dir: Path) -> None:
        cli = [sys.executable, "-m", "splitserve.cli"]
        self.port, self.http = free_port(), free_port()
        wport = free_port()
        sched_args = [
            "scheduler",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--worker-port",
            str(wport),
            "--http-port",
            str(self.http),
            "--max-num-seqs",
            "64",
            "--max-model-len",
            "2048",
            "--log-level",
            "WARNING",
        ]
        if spec:
            sched_args += ["--speculative-config", spec]
        name = "on" if spec else "off"
        self.procs = [Process(f"scheduler-{name}", cli + sched_args, log_dir)]
        worker_args = ["worker", "--scheduler", f"127.0.0.1:{wport}", "--worker-id", "w0"]
        worker_args += ["--num-threads", str(args.threads), "--dtype", args.dtype]
        worker_args += ["--log-level", "WARNING"]
        self.procs.append(Process(f"worker-{name}", cli + worker_args, log_dir))
        wait_until(lambda: "w0" in self.metrics(), self.procs[1], 600, "the worker attached")

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.http}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def counter(text: str, name: str) -> float:
    values = re.findall(rf"^splitserve:{name}(?:_total|_sum)(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return sum(float(v) for v in values)


COUNTERS = (
    "spec_decode_num_drafts",
    "scheduler_steps",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "spec_decode_draft_seconds",
    "step_time_seconds",
)


async def closed_loop(target: str, prompts: list[list[int]], c: int, max_tokens: int):
    ns = argparse.Namespace(
        target=target, api_key=None, model=None, temperature=0.0, ignore_eos=True, timeout=3600.0
    )
    backend = GrpcBackend(ns)
    queue = list(enumerate(prompts))
    results = []
    t0 = time.perf_counter()

    async def stream() -> None:
        while queue:
            _, prompt = queue.pop(0)
            results.append(await backend.send(BenchRequest(prompt, max_tokens), t0))

    try:
        await asyncio.gather(*(stream() for _ in range(c)))
    finally:
        await backend.close()
    return results, time.perf_counter() - t0


def measure(
    server: Server, prompts: list[list[int]], c: int, args, num_requests: int, first: int = 0
) -> dict:
    """One turn: num_requests requests (prompts from `first` on, wrapping), c at a time."""
    batch = [prompts[(first + i) % len(prompts)] for i in range(num_requests)]
    before = server.metrics()
    results, seconds = event_loop.run(
        closed_loop(f"127.0.0.1:{server.port}", batch, c, args.max_tokens)
    )
    after = server.metrics()
    delta = {k: counter(after, k) - counter(before, k) for k in COUNTERS}
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    return {
        "tokens": sum(r.output_len for r in results),
        "seconds": seconds,
        "tpots": [r.tpot for r in results if r.tpot is not None],
        **delta,
    }


def summarize(c: int, turns: list[dict]) -> dict:
    """A row's turns added up."""
    seconds = sum(t["seconds"] for t in turns)
    total = {k: sum(t[k] for t in turns) for k in COUNTERS}
    drafted = total["spec_decode_num_draft_tokens"]
    return {
        "concurrency": c,
        "turns": len(turns),
        "tokens": sum(t["tokens"] for t in turns),
        "seconds": seconds,
        "out_tok_s": sum(t["tokens"] for t in turns) / seconds,
        "tpot_p50_ms": 1e3 * statistics.median([x for t in turns for x in t["tpots"]]),
        "drafted": drafted,
        "verifications": total["spec_decode_num_drafts"],
        "steps": total["scheduler_steps"],
        "accepted": total["spec_decode_num_accepted_tokens"],
        "acceptance": total["spec_decode_num_accepted_tokens"] / drafted if drafted else None,
        "draft_share": total["spec_decode_draft_seconds"] / total["step_time_seconds"]
        if total["step_time_seconds"]
        else None,
    }


def main() -> int:
    args = parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    workloads = args.workloads.split(",")
    prompts = {w: load_prompts(w) for w in workloads}
    log_dir = args.log_dir or Path(f"/tmp/splitserve-spec-{int(time.time())}")
    log_dir.mkdir(parents=True, exist_ok=True)
    rows: dict[tuple[str, int], dict[str, dict]] = {}
    servers = {"off": Server(args, None, log_dir)}
    try:
        servers["on"] = Server(args, args.spec, log_dir)
        for server in servers.values():  # each workload once, so no measured turn pays set-up
            for w in workloads:
                measure(server, prompts[w], 2, args, num_requests=2)
        with Progress(console=console) as progress:
            task = progress.add_task("turns", total=len(workloads) * len(levels) * args.turns)
            for w in workloads:
                for c in levels:
                    n = max(args.waves * c, args.turn_requests)
                    runs: dict[str, list[dict]] = {"off": [], "on": []}
                    for turn in range(args.turns):
                        progress.update(task, description=f"{w} x{c}")
                        for setting, server in servers.items():
                            runs[setting].append(measure(server, prompts[w], c, args, n, turn * n))
                        progress.advance(task)
                    rows[(w, c)] = {k: summarize(c, v) for k, v in runs.items()}
                    rows[(w, c)]["turn_ratios"] = [
                        (on["tokens"] / on["seconds"]) / (off["tokens"] / off["seconds"])
                        for off, on in zip(runs["off"], runs["on"], strict=True)
                    ]
    finally:
        for server in servers.values():
            server.stop()
    table = Table(title=f"speculative decoding off / on ({args.spec}), {args.dtype}")
    for col in (
        "workload",
        "streams",
        "off tok/s",
        "on tok/s",
        "on ÷ off",
        "turns' on ÷ off (min / median / max)",
        "TPOT p50 off/on (ms)",
        "acceptance",
        "drafting share",
    ):
        table.add_column(col)
    for (w, c), r in rows.items():
        off, on = r["off"], r["on"]
        acc = f"{on['acceptance']:.2f}" if on["acceptance"] is not None else "-"
        share = f"{100 * on['draft_share']:.2f}%" if on["draft_share"] is not None else "-"
        table.add_row(
            w,
            str(c),
            f"{off['out_tok_s']:.1f}",
            f"{on['out_tok_s']:.1f}",
            f"{on['out_tok_s'] / off['out_tok_s']:.2f}",
            " / ".join(
                f"{x:.2f}"
                for x in (
                    min(r["turn_ratios"]),
                    statistics.median(r["turn_ratios"]),
                    max(r["turn_ratios"]),
                )
            ),
            f"{off['tpot_p50_ms']:.0f} / {on['tpot_p50_ms']:.0f}",
            acc,
            share,
        )
    Console(width=200).print(table)
    out = {
        "spec": args.spec,
        "max_tokens": args.max_tokens,
        "rows": [{"workload": w, **{k: r for k, r in v.items()}} for (w, _), v in rows.items()],
    }
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    if args.plot:
        plot(rows, args.plot)
    return 0


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({w for w, _ in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 3.6), squeeze=False)
    for ax, w in zip(axes[0], workloads, strict=True):
        levels = sorted(c for ww, c in rows if ww == w)
        xs = range(len(levels))
        for k, (setting, color) in enumerate((("off", "#888888"), ("on", "#2a7ab0"))):
            ys = [rows[(w, c)][setting]["out_tok_s"] for c in levels]
            ax.bar([x + 0.4 * k for x in xs], ys, 0.4, label=f"speculation {setting}", color=color)
        ax.set_xticks([x + 0.2 for x in xs], [str(c) for c in levels])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("out tok/s")
        ax.set_title(w)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
