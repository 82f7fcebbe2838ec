"""Float GEMM rates on this machine, and the rate the runner's linear layers achieve.

`peak_gemm_rate` times large GEMMs (the machine's best case); `linear_rate_in_decode` profiles
pure-decode steps of the runner and divides the linear layers' FLOPs (2 x rows x in x out, the
lm_head on one row per request) by the time the profiler attributes to their GEMM ops.
Used by bench/worker_forward.py (section `gemm`), so both numbers come from the same run.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from worker_svc import packed_gemm
from worker_svc.fast_linear import NativePackedLinear

# CPU GEMM kernels: MKL (aten), oneDNN, worker_svc/packed_gemm.py
GEMM_OPS = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "splitserve::packed_sgemm")
LINEAR_REPLACEMENTS = ("TransposedLinear", "PackedLinear", "NativePackedLinear")  # fast_linear
PEAK_SHAPES = ((2048, 576, 1536), (2048, 1536, 576), (1024, 2048, 2048))


def _time(fn: Callable[[], object], seconds: float = 0.5) -> float:
    for _ in range(3):
        fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        n += 1
    return (time.perf_counter() - start) / n


def peak_gemm_rate(dtype: torch.dtype, device: torch.device) -> dict:
    """Best GFLOP/s over a few large GEMM shapes, by BLAS (`x @ w`) and, in float32 on the CPU
    where it loads, by the worker's packed kernel: the faster of the two is the machine's rate."""
    gemm = packed_gemm.load() if dtype == torch.float32 and device.type == "cpu" else None
    rates = {}
    for m, k, n in PEAK_SHAPES:
        x = torch.randn(m, k, device=device).to(dtype)
        w = torch.randn(k, n, device=device).to(dtype)
        rates[f"{m}x{k}x{n}"] = 2 * m * k * n / _time(lambda x=x, w=w: x @ w) / 1e9
        if gemm is not None:
            packed = gemm.pack(w.t().contiguous())
            run = lambda x=x, p=packed, n=n: gemm(x, p, n, None)  # noqa: E731
            rates[f"{m}x{k}x{n} packed"] = 2 * m * k * n / _time(run) / 1e9
    return {"gflops": max(rates.values()), "shapes": rates}


def linear_flops_per_step(model: nn.Module, rows: int) -> int:
    """FLOPs of every linear layer for `rows` decode tokens (lm_head included: one per row)."""
    total = 0
    for module in model.modules():
        fan = getattr(module, "in_features", None), getattr(module, "out_features", None)
        if isinstance(module, nn.Linear) or type(module).__name__ in LINEAR_REPLACEMENTS:
            total += 2 * rows * fan[0] * fan[1]
    return total


def linear_rate_in_decode(
    step: Callable[[], object], model: nn.Module, rows: int, steps: int
) -> dict:
    """Time the linear layers over `steps` calls of `step` (one decode step of `rows` requests
    each): with the native packed GEMM by its own wall-time counter (no profiler: its per-call
    bookkeeping, tens of µs in Python, would be counted as GEMM time), else with the profiler's
    self time of the BLAS ops."""
    step()
    gemm = packed_gemm.load()
    if gemm is not None and any(isinstance(m, NativePackedLinear) for m in model.modules()):
        method, before = "kernel timer", gemm.elapsed_s()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - start
        gemm_s = (gemm.elapsed_s() - before) / steps
    else:
        method = "profiler"
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                step()
            wall = time.perf_counter() - start
        gemm_us = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in GEMM_OPS)
        gemm_s = gemm_us / 1e6 / steps
    flops = linear_flops_per_step(model, rows)
    return {
        "rows": rows,
        "timed_by": method,
        "linear_gflop_per_step": flops / 1e9,
        "gemm_ms_per_step": gemm_s * 1e3,
        "step_ms": wall / steps * 1e3,
        "gflops": flops / gemm_s / 1e9,
    }
