"""Float GEMM rates on this machine, and the rate the runner's linear layers achieve.

`peak_gemm_rate` times large GEMMs (the machine's best case); `linear_rate_in_decode` profiles
pure-decode steps of the runner and divides the linear layers' FLOPs (2 x rows x in x out, the
lm_head on one row per request) by the time spent in their GEMM kernels.
Used by bench/worker_forward.py (sections `gemm` and `ops`), so all numbers come from one run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile

from worker_svc import amx_gemm, packed_gemm
from worker_svc.model import CausalLM
from worker_svc.ops import native_linear
from worker_svc.ops.native_linear import NativePackedLinear

# CPU GEMM kernels as the profiler names them: MKL (aten), oneDNN, the worker's native kernels
GEMM_OPS = (
    "aten::mm",
    "aten::addmm",
    "aten::linear",
    "mkldnn::_linear_pointwise",
    packed_gemm.PROFILE_NAME,
    amx_gemm.PROFILE_NAME,
)
PEAK_SHAPES = ((2048, 576, 1536), (2048, 1536, 576), (1024, 2048, 2048))


def _time(fn: Callable[[], object], seconds: float = 0.5) -> float:
    for _ in range(3):
        fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or n < 2:
        fn()
        n += 1
    return (time.perf_counter() - start) / n


def peak_gemm_rate(dtype: torch.dtype, device: torch.device, seconds: float = 0.5) -> dict:
    """Best GFLOP/s over a few large GEMM shapes, by BLAS (`x @ w`) and, on the CPU, by the
    native backend's linear kind for `dtype` (the packed GEMM in float32, AMX / oneDNN / the
    widening packed GEMM in bfloat16): the fastest is the machine's GEMM ceiling."""
    kind = native_linear.linear_kind(dtype) if device.type == "cpu" else "torch"
    rates = {}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        for m, k, n in PEAK_SHAPES:
            x = torch.randn(m, k, device=device).to(dtype)
            w = torch.randn(k, n, device=device).to(dtype)

            def blas(x=x, w=w) -> None:
                x @ w
                sync()

            rates[f"{m}x{k}x{n}"] = 2 * m * k * n / _time(blas, seconds) / 1e9
            if kind not in ("torch", "transposed"):  # transposed: the same BLAS as above
                linear = native_linear.make_linear(kind, w.t().contiguous(), None)
                rates[f"{m}x{k}x{n} {kind}"] = (
                    2 * m * k * n / _time(lambda x=x, f=linear: f(x), seconds) / 1e9
                )
    return {"gflops": max(rates.values()), "shapes": rates}


def leaf_linears(model: CausalLM) -> Iterator[object]:
    """The GEMM-running linears of the model (inside the q/k/v split and the gated product)."""
    for layer in model.layers:
        for outer in (layer.qkv, layer.o_proj, layer.gated, layer.down_proj):
            if hasattr(outer, "linear"):  # SplitLinear
                yield outer.linear
            elif hasattr(outer, "linears"):  # SeparateLinears
                yield from outer.linears
            elif hasattr(outer, "gate_up"):  # GatedProduct
                yield outer.gate_up
            elif hasattr(outer, "gate"):  # NativeGatedProduct
                yield from (outer.gate, outer.up)
            else:
                yield outer
    yield model.lm_head


def linear_flops_per_token(model: CausalLM) -> int:
    """FLOPs of every decoder layer's linears for one token (the lm_head not included)."""
    s = model.spec
    q_kv = s.hidden_size * (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    o = s.num_heads * s.head_dim * s.hidden_size
    mlp = 3 * s.hidden_size * s.intermediate_size
    return 2 * (q_kv + o + mlp) * s.num_layers


def lm_head_flops_per_row(model: CausalLM) -> int:
    return 2 * model.spec.hidden_size * model.spec.vocab_size


def linear_flops_per_step(model: CausalLM, rows: int) -> int:
    """FLOPs of every linear layer for `rows` decode tokens (lm_head included: one per row)."""
    return rows * (linear_flops_per_token(model) + lm_head_flops_per_row(model))


def linear_rate_in_decode(
    step: Callable[[], object], model: CausalLM, rows: int, steps: int
) -> dict:
    """Time the linear layers over `steps` calls of `step` (one decode step of `rows` requests
    each): with the native packed GEMM by its own wall-time counter (no profiler: its per-call
    bookkeeping, tens of µs in Python, would be counted as GEMM time; the native decode stack
    runs the same kernel and is counted too), else with the profiler's self time of the GEMM
    ops (the profiler turns the decode stack off: the layer loop runs)."""
    step()
    gemm = packed_gemm.load()
    if gemm is not None and all(isinstance(m, NativePackedLinear) for m in leaf_linears(model)):
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
        events = prof.key_averages()
        gemm_us = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS)
        gemm_s = gemm_us / 1e6 / steps
    flops = linear_flops_per_step(model, rows)
    return {
        "rows": rows,
        "timed_by": method,
        "linear_gflop_per_step": flops / 1e9,
        "gemm_ms_per_step": gemm_s * 1e3,
        "step_ms": wall / steps * 1e3,
        "gflops": flops / gemm_s / 1e9 if gemm_s else float("nan"),
    }
