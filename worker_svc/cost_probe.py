"""Measure, at start, what the scheduler's preemption cost model needs (reported in Register).

- prefill: the runner prefills chunks of three sizes (one throwaway request on blocks nothing
  uses yet); ``t = a + p*n + q*n^2/2`` fitted to them gives seconds per token (p) and per token
  per context token (q, attention).
- swap: device -> host and host -> device copies of 1 and k KV blocks give the bandwidth and the
  fixed latency of one copy; plus the bytes of one block.

- verification steps: a step of one request scoring 2^i - 1 drafts after its next token, for
  2^i = 1, 2, 4, ... MAX_VERIFY_WIDTH tokens (the first a plain decode step). Where the step
  time stops being flat, the forward pass has turned from reading the weights to arithmetic; the
  scheduler sizes each step's drafts by this curve (scheduler_svc/core/draft_budget.py).

Only a worker with host blocks can swap, so only such a worker measures the prefill and the
copies (about a second on CPU for the default model, milliseconds on a GPU); the others report
no preemption costs and the scheduler keeps its defaults. Every worker with a model measures the
verification steps (a few hundred milliseconds on CPU).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from common.messages import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput

PROBE_ID = "__cost_probe__"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prefill_step(runner, n: int, max_tokens: int) -> SchedulerOutput:
    """The step that admits the probe request: a prompt of n tokens, prefilled whole, on the
    first blocks of the pool (nothing uses them before serving)."""
    vocab = max(4, getattr(runner, "vocab_size", 1000) - 3)
    prompt = [(j * 7) % vocab + 3 for j in range(n)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    blocks = list(range(-(-n // runner.block_size)))
    return SchedulerOutput(
        new_requests=[NewRequestData(PROBE_ID, prompt, params, blocks, 0)],
        num_scheduled_tokens={PROBE_ID: n},
        total_num_scheduled_tokens=n,
    )


def time_throwaway_prefill(runner, n: int) -> float:
    """Seconds of one prefill of n tokens by a request that is then finished (on blocks
    nothing uses yet: call it before serving, or between sessions)."""
    so = _prefill_step(runner, n, max_tokens=1)
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


MAX_VERIFY_WIDTH = 64
VERIFY_PROMPT = 16  # the probe request's prompt: a short context, so the rows read little KV


def measure_verify_steps(runner, repeats: int = 3) -> list[float]:
    """Seconds of a step of 1, 2, 4, ... tokens of one request (its next token and the rest
    drafts), the fastest of `repeats`; [] where the runner cannot hold the probe."""
    bs = runner.block_size
    widths = []
    width = 1
    while width <= min(MAX_VERIFY_WIDTH, runner.config.max_num_batched_tokens):
        widths.append(width)
        width *= 2
    # every width's tokens may be kept (drafts accepted), each step's next one too: blocks
    # for all of them
    span = VERIFY_PROMPT + 1 + sum(widths) + len(widths)
    if span > runner.max_model_len or -(-span // bs) > runner.num_blocks:
        return []
    vocab = max(4, runner.vocab_size - 3)
    best = [float("inf")] * len(widths)
    for _ in range(repeats):
        out = runner.execute_model(_prefill_step(runner, VERIFY_PROMPT, max_tokens=span))
        computed = VERIFY_PROMPT
        known = computed + len(out.sampled_token_ids[PROBE_ID])
        for i, width in enumerate(widths):
            drafts = [(known * 7 + j) % vocab + 3 for j in range(width - 1)]
            held, need = -(-computed // bs), -(-(computed + width) // bs)
            so = SchedulerOutput(
                cached_requests=[CachedRequestData(PROBE_ID, list(range(held, need)), computed)],
                num_scheduled_tokens={PROBE_ID: width},
                total_num_scheduled_tokens=width,
                spec_token_ids={PROBE_ID: drafts} if drafts else {},
            )
            _sync(runner.device)
            start = time.perf_counter()
            out = runner.execute_model(so)
            _sync(runner.device)
            best[i] = min(best[i], time.perf_counter() - start)
            # its next token + the drafts kept; the worker holds the blocks of its computed
            # tokens (those past them went with the rejected positions)
            kept = len(out.sampled_token_ids[PROBE_ID])
            computed, known = known + kept - 1, known + kept
        runner.execute_model(SchedulerOutput(finished_req_ids={PROBE_ID}))
    return best


def measure_costs(runner) -> dict[str, float | int | list[float]]:
    """The Register fields: the verification steps, and with host blocks the preemption cost
    model's."""
    kv = getattr(runner, "kv_cache", None)
    if kv is None:
        return {}
    costs: dict[str, float | int | list[float]] = {}
    try:
        with torch.inference_mode():
            costs["verify_step_s"] = measure_verify_steps(runner)
            if runner.num_host_blocks > 0:
                per_token, per_ctx = measure_prefill(runner)
                bandwidth, latency, per_block = measure_swap(kv)
                costs.update(
                    prefill_s_per_token=per_token,
                    prefill_s_per_token_ctx=per_ctx,
                    swap_bytes_per_s=bandwidth,
                    swap_latency_s=latency,
                    kv_bytes_per_block=per_block,
                )
    finally:
        runner.reset()
    return costs
