"""Measure, at start, what the scheduler's preemption cost model needs (reported in Register).

- prefill: the runner prefills chunks of three sizes (one throwaway request on blocks nothing
  uses yet); ``t = a + p*n + q*n^2/2`` fitted to them gives seconds per token (p) and per token
  per context token (q, attention).
- swap: device -> host and host -> device copies of 1 and k KV blocks give the bandwidth and the
  fixed latency of one copy; plus the bytes of one block.

Only a worker with host blocks can swap, so only such a worker measures (about a second on CPU
for the default model, milliseconds on a GPU); the others report nothing and the scheduler keeps
its defaults.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from common.messages import NewRequestData, SamplingParams, SchedulerOutput

PROBE_ID = "__cost_probe__"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_throwaway_prefill(runner, n: int) -> float:
    """Seconds of one prefill of n tokens by a request that is then finished (on blocks
    nothing uses yet: call it before serving, or between sessions)."""
    bs = runner.block_size
    vocab = max(4, getattr(runner, "vocab_size", 1000) - 3)
    prompt = [(j * 7) % vocab + 3 for j in range(n)]
    so = SchedulerOutput(
        new_requests=[
            NewRequestData(
                PROBE_ID,
                prompt,
                SamplingParams(max_tokens=1, temperature=0.0),
                list(range(-(-n // bs))),
                0,
            )
        ],
        num_scheduled_tokens={PROBE_ID: n},
        total_num_scheduled_tokens=n,
    )
    _sync(runner.device)
    start = time.perf_counter()
    runner.execute_model(so)
    _sync(runner.device)
    elapsed = time.perf_counter() - start
    runner.execute_model(SchedulerOutput(finished_req_ids={PROBE_ID}))
    return elapsed


def measure_prefill(runner, repeats: int = 1) -> tuple[float, float]:
    """(seconds per token, seconds per token per context token)."""
    bs = runner.block_size
    cap = min(
        128, runner.config.max_num_batched_tokens, runner.max_model_len - 1, runner.num_blocks * bs
    )
    sizes = sorted({max(1, cap // 4), max(1, cap // 2), cap})
    if len(sizes) < 2:
        return 0.0, 0.0
    time_throwaway_prefill(runner, sizes[0])  # warm-up
    ts = [min(time_throwaway_prefill(runner, n) for _ in range(repeats)) for n in sizes]
    ns = np.array(sizes, dtype=float)
    y = np.array(ts)
    x = np.stack([np.ones_like(ns), ns, ns * ns / 2], axis=1)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    if coef[2] < 0 or coef[1] < 0:  # noise: a straight line, then a proportional one
        slope, _ = np.polyfit(ns, y, 1)
        coef = [0.0, slope if slope > 0 else y[-1] / ns[-1], 0.0]
    return float(coef[1]), float(coef[2])


def measure_swap(kv_cache, repeats: int = 3) -> tuple[float, float, int]:
    """(bytes per second one way, seconds of latency per copy, bytes per block)."""
    per_block = kv_cache.device_cache[:, :, 0].numel() * kv_cache.device_cache.element_size()
    k = min(16, kv_cache.num_host_blocks, kv_cache.num_blocks)
    rows = []
    for size in sorted({1, k}):
        pairs = [(i, i) for i in range(size)]
        for copy in (kv_cache.swap_out, kv_cache.swap_in):
            best = float("inf")
            for _ in range(repeats):
                _sync(kv_cache.device)
                start = time.perf_counter()
                copy(pairs)
                _sync(kv_cache.device)
                best = min(best, time.perf_counter() - start)
            rows.append((size, best))
    sizes = np.array([s for s, _ in rows], dtype=float)
    ts = np.array([t for _, t in rows])
    if len(set(sizes.tolist())) > 1:
        slope, intercept = np.polyfit(sizes, ts, 1)
    else:
        slope, intercept = ts.mean() / sizes[0], 0.0
    slope = max(float(slope), 1e-12)
    return per_block / slope, max(0.0, float(intercept)), int(per_block)


def measure_costs(runner) -> dict[str, float | int]:
    """The Register fields for the preemption cost model; {} when this worker cannot swap."""
    kv = getattr(runner, "kv_cache", None)
    if kv is None or runner.num_host_blocks <= 0:
        return {}
    try:
        with torch.inference_mode():
            per_token, per_ctx = measure_prefill(runner)
            bandwidth, latency, per_block = measure_swap(kv)
    finally:
        runner.reset()
    return {
        "prefill_s_per_token": per_token,
        "prefill_s_per_token_ctx": per_ctx,
        "swap_bytes_per_s": bandwidth,
        "swap_latency_s": latency,
        "kv_bytes_per_block": per_block,
    }
