"""A verification step's cost by layout: 1 + k decode rows or one chunk, on the worker alone.

    .venv/bin/python bench/verify_layout.py                          # contexts 150 and 1900
    .venv/bin/python bench/verify_layout.py --contexts 1000 --drafts 0,6,12 --json out.json

One request with a prompt of `context` tokens (bench/data/essays.txt) decodes through a
Scheduler and the ModelRunner in this process; each step drafts k wrong tokens (all rejected, so
every step costs the same). A step is timed as 1 + k decode rows over the request's block table
(the native layout, worker_svc/step_inputs.py) and as one chunk (MAX_VERIFY_ROW_READS set to 0),
the two taking turns; the table keeps the fastest of --repeats runs of --steps steps (median
step each), and k = 0 is the plain decode step beside them. Also prints the worker's start-up
curve (worker_svc/cost_probe.py: steps of 1, 2, 4, ... 64 tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from tqdm import tqdm  # noqa: E402

from common.messages import SamplingParams  # noqa: E402
from common.model_source import resolve_model  # noqa: E402
from common.tokenizer import load_tokenizer  # noqa: E402
from scheduler_svc.core import Request, Scheduler, SchedulerConfig  # noqa: E402
from scheduler_svc.core.speculative import SpeculativeConfig  # noqa: E402
from worker_svc import step_inputs  # noqa: E402
from worker_svc.config import ModelRunnerConfig  # noqa: E402
from worker_svc.cost_probe import measure_verify_steps  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402


class WrongDrafts:
    """k drafts every step, never the model's token (a proposer for timing only)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def wants(self, request) -> bool:
        return True

    active = wants

    def propose(self, request, max_tokens: int) -> list[int]:
        return [17] * min(self.k, max_tokens)

    def record(self, request, num_drafted: int, num_accepted: int) -> None:
        """Nothing to learn: the drafts are fixed."""

    def forget(self, request_id: str) -> None:
        """Nothing kept per request."""


def step_ms(runner: ModelRunner, prompt: list[int], k: int, steps: int) -> float:
    runner.reset()
    spec = SpeculativeConfig(num_speculative_tokens=max(k, 1), max_batch=64) if k else None
    sched = Scheduler(
        SchedulerConfig(num_blocks=runner.num_blocks, max_model_len=4096, speculative=spec)
    )
    if k:
        sched._proposer = WrongDrafts(k)  # noqa: SLF001
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    sched.add_request(Request("r", prompt, params, eos_token_id=None))
    times = []
    for _ in range(steps + 1):
        out = sched.schedule()
        if not out.total_num_scheduled_tokens:
            break
        start = time.perf_counter()
        result = runner.execute_model(out)
        times.append(time.perf_counter() - start)
        sched.update_from_output(out, result.sampled_token_ids)
    return 1e3 * statistics.median(times[1:])  # the prefill left out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--contexts", default="150,1900", help="comma list of prompt lengths")
    p.add_argument("--drafts", default="0,1,2,4,6,8,12,16", help="comma list of k")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    runner = ModelRunner(
        ModelRunnerConfig(num_threads=args.threads, dtype=args.dtype, warmup_tokens=512)
    )
    with torch.inference_mode():
        curve = [1e3 * t for t in measure_verify_steps(runner)]
    tokenizer = load_tokenizer(resolve_model(None))
    text_ids = tokenizer.encode((ROOT / "bench/data/essays.txt").read_text())
    contexts = [int(c) for c in args.contexts.split(",")]
    drafts = [int(k) for k in args.drafts.split(",")]
    default_bound = step_inputs.MAX_VERIFY_ROW_READS
    best: dict[tuple[int, int, str], float] = {}
    jobs = [(c, k, layout) for c in contexts for k in drafts for layout in ("rows", "chunk")]
    jobs = [(c, k, layout) for c, k, layout in jobs if k or layout == "rows"]
    with tqdm(total=len(jobs) * args.repeats, desc="steps") as bar:
        for _ in range(args.repeats):
            for c, k, layout in jobs:
                prompt = (text_ids * (c // len(text_ids) + 1))[:c]
                step_inputs.MAX_VERIFY_ROW_READS = 1 << 62 if layout == "rows" else 0
                ms = step_ms(runner, prompt, k, args.steps)
                best[(c, k, layout)] = min(ms, best.get((c, k, layout), float("inf")))
                bar.update()
    step_inputs.MAX_VERIFY_ROW_READS = default_bound
    table = Table(title=f"verification step (ms), one request, {args.dtype}")
    for col in ("context", "drafts", "as decode rows", "as one chunk"):
        table.add_column(col)
    for c in contexts:
        for k in drafts:
            chunk = best.get((c, k, "chunk"))
            rows = best[(c, k, "rows")]
            table.add_row(str(c), str(k), f"{rows:.1f}", "-" if chunk is None else f"{chunk:.1f}")
    console = Console(width=160)
    console.print(table)
    console.print(
        "start-up curve (ms, steps of 1, 2, 4, ... tokens): " + ", ".join(f"{t:.1f}" for t in curve)
    )
    if args.json:
        steps = [
            {"context": c, "drafts": k, "layout": layout, "ms": ms}
            for (c, k, layout), ms in best.items()
        ]
        args.json.write_text(json.dumps({"steps": steps, "curve_ms": curve}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
