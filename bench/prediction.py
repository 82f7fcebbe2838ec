"""Predicted Outputs: a rewrite workload with and without the text as the prediction, in one run.

    .venv/bin/python bench/prediction.py                        # 8 requests x 2 turns, ~3 min
    .venv/bin/python bench/prediction.py --requests 4 --turns 1 --json prediction.json

The scheduler core and the ModelRunner (the default model, SmolLM2-135M-Instruct) in this
process, as a worker and its scheduler run them, without the links: the worker's start-up
curve (worker_svc/cost_probe.py) sizes the draft budget, as on a server. The requests are chat
prompts that rewrite a paragraph of bench/data/essays.txt: "repeat this text exactly" and "fix
the typo in this paragraph" (one word with two letters swapped), taking turns; greedy, each
ends at EOS or --max-tokens. Settings, on the same requests, each turn all of them in turn:

- off: no --speculative-config, no prediction;
- prompt lookup: --speculative-config '{"method": "ngram"}', no prediction;
- prediction: no --speculative-config, the paragraph (as the prompt has it) as the prediction.

--concurrency requests run at once (closed loop). Printed per setting: output tokens per
second, latency per request (mean and p50), decode steps, accepted draft tokens per step,
acceptance (accepted / drafted tokens), and how many outputs equal the 'off' ones.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# before torch loads OpenMP: an idle thread sleeps instead of spinning on a shared machine
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from tqdm import tqdm  # noqa: E402

from common.messages import SamplingParams  # noqa: E402
from common.model_source import resolve_model  # noqa: E402
from common.tokenizer import load_tokenizer  # noqa: E402
from scheduler_svc.core import Request, Scheduler, SchedulerConfig  # noqa: E402
from scheduler_svc.core.preemption_cost import WorkerCosts  # noqa: E402
from scheduler_svc.core.speculative import SpeculativeConfig  # noqa: E402
from worker_svc.config import ModelRunnerConfig  # noqa: E402
from worker_svc.cost_probe import measure_verify_steps  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402

SETTINGS = ("off", "prompt lookup", "prediction")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=8, help="rewrite requests per turn")
    p.add_argument("--turns", type=int, default=2, help="turns of every setting")
    p.add_argument("--concurrency", type=int, default=1, help="requests at once")
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens at most")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    return p.parse_args()


def with_typo(paragraph: str, rng: random.Random) -> str:
    """One word of 5+ letters with two inner letters swapped."""
    words = paragraph.split(" ")
    long = [i for i, w in enumerate(words) if len(w) >= 5 and w.isalpha()]
    if not long:
        return paragraph
    i = rng.choice(long)
    w = words[i]
    j = rng.randrange(1, len(w) - 2)
    words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2 :]
    return " ".join(words)


def workload(tokenizer, n: int) -> list[tuple[list[int], tuple[int, ...]]]:
    """(prompt ids, prediction ids) per request: repeat exactly / fix the typo, in turn."""
    text = (ROOT / "bench/data/essays.txt").read_text()
    paragraphs = [p.strip() for p in text.split("\n\n") if 200 < len(p.strip()) < 900]
    rng = random.Random(0)
    jobs = []
    for i in range(n):
        paragraph = paragraphs[i % len(paragraphs)]
        if i % 2 == 0:
            ask = f"Repeat the following text exactly, word for word:\n\n{paragraph}"
        else:
            paragraph = with_typo(paragraph, rng)
            ask = (
                "Fix the typo in this paragraph and write the whole corrected paragraph, "
                f"nothing else:\n\n{paragraph}"
            )
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": ask}], add_generation_prompt=True
        )
        jobs.append((list(prompt), tuple(tokenizer.encode(paragraph, add_special_tokens=False))))
    return jobs


def run_setting(runner, costs: WorkerCosts, setting: str, jobs, args, bar) -> dict:
    """All jobs through a fresh scheduler, --concurrency at a time; the setting's figures."""
    runner.reset()
    spec = SpeculativeConfig() if setting == "prompt lookup" else None
    sched = Scheduler(
        SchedulerConfig(
            block_size=runner.block_size,
            num_blocks=runner.num_blocks,
            max_model_len=runner.max_model_len,
            max_num_seqs=64,
            max_num_batched_tokens=2048,
            speculative=spec,
            worker_costs=costs,
        )
    )
    queue = list(enumerate(jobs))
    started: dict[str, float] = {}
    latency: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}

    def admit() -> None:
        i, (prompt, prediction) = queue.pop(0)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=0.0,
            prediction=prediction if setting == "prediction" else (),
        )
        rid = f"r{i}"
        sched.add_request(Request(rid, prompt, params, eos_token_id=runner.eos_token_id))
        started[rid] = time.perf_counter()
        outputs[rid] = []

    t0 = time.perf_counter()
    while queue and len(started) - len(latency) < args.concurrency:
        admit()
    steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        steps += 1
        result = runner.execute_model(out)
        for o in sched.update_from_output(out, result.sampled_token_ids):
            outputs[o.request_id].extend(o.new_token_ids)
            if o.finish_reason is not None:
                latency[o.request_id] = time.perf_counter() - started[o.request_id]
                bar.update()
                if queue:
                    admit()
    seconds = time.perf_counter() - t0
    runner.execute_model(sched.schedule())  # the finished requests leave the runner
    stats = sched.stats()
    tokens = sum(map(len, outputs.values()))
    return {
        "seconds": seconds,
        "tokens": tokens,
        "steps": steps,
        "latencies": [latency[r] for r in sorted(latency)],
        "drafted": stats.num_spec_draft_tokens,
        "accepted": stats.num_spec_accepted_tokens,
        "outputs": {r: outputs[r] for r in sorted(outputs)},
    }


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    runner = ModelRunner(ModelRunnerConfig(num_threads=args.threads, dtype=args.dtype))
    with torch.inference_mode():
        costs = WorkerCosts(verify_step_s=tuple(measure_verify_steps(runner)))
    jobs = workload(load_tokenizer(resolve_model(None)), args.requests)
    turns: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    total = args.turns * len(SETTINGS) * len(jobs)
    with tqdm(total=total, desc="requests") as bar, torch.inference_mode():
        for _ in range(args.turns):
            for setting in SETTINGS:
                turns[setting].append(run_setting(runner, costs, setting, jobs, args, bar))
    rows = []
    reference = turns["off"][0]["outputs"]
    for setting in SETTINGS:
        runs = turns[setting]
        latencies = [x for r in runs for x in r["latencies"]]
        steps = sum(r["steps"] for r in runs)
        drafted, accepted = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
        same = sum(r["outputs"][rid] == reference[rid] for r in runs for rid in r["outputs"]) / len(
            runs
        )
        rows.append(
            {
                "setting": setting,
                "out_tok_s": sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs),
                "latency_mean_s": statistics.fmean(latencies),
                "latency_p50_s": statistics.median(latencies),
                "steps": steps / len(runs),
                "accepted_per_step": accepted / steps,
                "acceptance": accepted / drafted if drafted else None,
                "output_tokens": sum(r["tokens"] for r in runs) / len(runs),
                "same_as_off": same,
                "requests": len(jobs),
            }
        )
    title = (
        f"rewrite workload: {len(jobs)} requests x {args.turns} turns, concurrency "
        f"{args.concurrency}, {args.dtype}, {args.threads} threads"
    )
    table = Table(title=title)
    columns = ("setting", "out tok/s", "latency mean (s)", "latency p50 (s)", "steps")
    columns += ("accepted / step", "acceptance", "outputs = off")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(
            row["setting"],
            f"{row['out_tok_s']:.1f}",
            f"{row['latency_mean_s']:.2f}",
            f"{row['latency_p50_s']:.2f}",
            f"{row['steps']:.0f}",
            f"{row['accepted_per_step']:.2f}",
            "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}",
            f"{row['same_as_off']:.0f}/{len(jobs)}",
        )
    Console(width=160).print(table)
    if args.json is not None:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"args": settings, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
