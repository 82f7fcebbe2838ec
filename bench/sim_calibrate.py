"""Calibrate the simulator's step-time model (splitserve/sim/costmodel.py) on the real runner.

Times the worker's ModelRunner (the same runner bench/worker_forward.py measures) on step shapes
that span what the scheduler sends: decode batches at several contexts, prefill chunks with and
without context before them, and a mix; fits

    step_s = base_s + per_token_s * tokens + per_ctx_token_s * attention_pairs + per_seq_s * seqs

(attention_pairs: sum over scheduled tokens of the context each attends to) by least squares,
times host <-> device block copies for the swap terms, and writes the profile, with this command
line, into splitserve/sim/calibration.json.

    .venv/bin/python bench/sim_calibrate.py --threads 2 --profile smollm2-cpu-fp32
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the worker (worker_svc/main.py)

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.messages import NewRequestData, SchedulerOutput  # noqa: E402
from scheduler_svc.core import SamplingParams  # noqa: E402
from worker_svc.config import ModelRunnerConfig  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
DEFAULT_OUT = ROOT / "splitserve" / "sim" / "calibration.json"


def shapes(quick: bool) -> list[list[tuple[int, int]]]:
    """Steps as lists of (scheduled tokens, context before them), one pair per request."""
    out: list[list[tuple[int, int]]] = []
    batches = (1, 8, 32) if quick else (1, 4, 16, 32, 64)
    for ctx in (64, 512, 1024):
        for b in batches:
            out.append([(1, ctx)] * b)
    for chunk in (32, 128, 512) if quick else (32, 128, 256, 512):
        for ctx in (0, 512):
            out.append([(chunk, ctx)])
    out.append([(1, 256)] * 16 + [(256, 0)])
    out.append([(1, 512)] * 32 + [(128, 512)])
    out.append([(64, 0)] * 4)
    return out


def features(step: list[tuple[int, int]]) -> list[float]:
    tokens = sum(n for n, _ in step)
    pairs = sum(n * c + n * (n + 1) / 2 for n, c in step)
    return [1.0, float(tokens), float(pairs), float(len(step))]


def time_step(runner: ModelRunner, step: list[tuple[int, int]], repeats: int) -> float:
    bs = runner.block_size
    times = []
    for k in range(repeats + 1):
        runner.reset()
        reqs, sched = [], {}
        for i, (n, c) in enumerate(step):
            rid = f"s{i}"
            total = c + n
            prompt = [(i * 131 + j * 7 + k) % 1000 + 10 for j in range(total)]
            blocks = list(range(-(-total // bs)))  # aliased across requests: timing only
            reqs.append(NewRequestData(rid, prompt, GREEDY, blocks, c))
            sched[rid] = n
        so = SchedulerOutput(
            new_requests=reqs,
            num_scheduled_tokens=sched,
            total_num_scheduled_tokens=sum(sched.values()),
        )
        t = time.perf_counter()
        runner.execute_model(so)
        times.append(time.perf_counter() - t)
    runner.reset()
    return min(times[1:])  # the least disturbed run (other processes share the machine)


def fit(x: np.ndarray, y: np.ndarray, names: list[str]) -> dict[str, float]:
    """Least squares with non-negative coefficients (drop a negative term, refit)."""
    keep = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep] / y[:, None], np.ones(len(y)), rcond=None)
        if (coef >= 0).all():
            break
        keep.pop(int(np.argmin(coef)))
    full = np.zeros(x.shape[1])
    full[keep] = coef
    return dict(zip(names, full.tolist(), strict=True))


def time_swaps(runner: ModelRunner, repeats: int) -> dict[str, float]:
    kv = runner.kv_cache
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    sizes = [k for k in (1, 4, 16, 64) if k <= min(kv.num_host_blocks, kv.num_blocks)]
    rows = []
    for k in sizes:
        pairs = [(i, i) for i in range(k)]
        for fn in (kv.swap_out, kv.swap_in):
            times = []
            for _ in range(repeats + 1):
                sync()
                t = time.perf_counter()
                fn(pairs)
                sync()
                times.append(time.perf_counter() - t)
            rows.append((k, min(times[1:])))
    per_block = kv.device_cache[:, :, 0].numel() * kv.device_cache.element_size()
    ks = np.array([k for k, _ in rows], dtype=float)
    ts = np.array([t for _, t in rows])
    slope, intercept = np.polyfit(ks, ts, 1)
    slope = max(slope, 1e-12)
    return {
        "swap_bytes_per_s": per_block / slope,
        "swap_latency_s": max(0.0, float(intercept)),
        "kv_bytes_per_block": int(per_block),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--profile", default="smollm2-cpu-fp32", help="name of the profile written")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--no-default", action="store_true", help="do not make it the default")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    steps = shapes(args.quick)
    longest = max(c + n for s in steps for n, c in s)
    cfg = ModelRunnerConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=16,
        num_gpu_blocks=-(-longest // 16) + 64,
        num_host_blocks=64,
        max_num_seqs=max(len(s) for s in steps),
        max_num_batched_tokens=2048,
        num_threads=args.threads,
    )
    runner = ModelRunner(cfg)
    print(f"{runner.model_name} {runner.dtype} on {runner.device}, {args.threads} threads")
    x, y = [], []
    with torch.inference_mode():
        for step in steps:
            t = time_step(runner, step, args.repeats)
            f = features(step)
            x.append(f)
            y.append(t)
            print(f"  {len(step):3d} seqs {f[1]:5.0f} tok {f[2]:8.0f} pairs: {t * 1e3:8.2f} ms")
        swaps = time_swaps(runner, args.repeats)
    xa, ya = np.array(x), np.array(y)
    coef = fit(xa, ya, ["base_s", "per_token_s", "per_ctx_token_s", "per_seq_s"])
    pred = xa @ np.array(list(coef.values()))
    rel = np.abs(pred - ya) / ya
    profile = {
        **coef,
        **swaps,
        "description": f"{runner.model_name} {args.dtype} on {runner.device}, "
        f"{args.threads} torch threads",
        "command": "python " + shlex.join([os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
        "measured_on": f"{platform.node()} {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
        f"torch {torch.__version__}, {datetime.date.today().isoformat()}",
        "fit": {
            "steps": len(ya),
            "mean_rel_error": float(rel.mean()),
            "max_rel_error": float(rel.max()),
        },
    }
    data = json.loads(args.out.read_text()) if args.out.exists() else {"profiles": {}}
    data["profiles"][args.profile] = profile
    if not args.no_default or "default" not in data:
        data["default"] = args.profile
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(profile, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
