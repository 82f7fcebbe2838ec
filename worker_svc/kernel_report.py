"""Which kernel runs each op on this machine: `splitserve worker --print-capabilities`, the
worker's start-up log and its registration (the scheduler's dashboard shows it).

Asked of the loaders themselves (not derived from the CPU level), so what is printed is what
the runner will take.
"""

from __future__ import annotations

import torch

from worker_svc import cpu_caps, fused_ops, native_attention, packed_gemm
from worker_svc.ops.native_linear import KINDS as LINEAR_KINDS
from worker_svc.ops.native_linear import linear_kind


def kernel_choices() -> dict[str, str]:
    """Op -> the kernel this machine runs it with (CPU; a CUDA worker runs torch's ops)."""
    caps = cpu_caps.capabilities()
    native = native_attention.load()
    gemm, ops = packed_gemm.load(), fused_ops.load()
    prefill = native is not None and native.has_prefill
    return {
        "cpu level": caps.describe(),
        "native library": native.path.name if native else "none (no C compiler, no prebuilt)",
        "linear float32": LINEAR_KINDS[linear_kind(torch.float32)],
        "linear bfloat16": _bfloat16_linear(),
        "linear int8 (--quantization)": "native packed GEMM, int8 widened to float32"
        if gemm is not None and gemm.has_int8
        else "none (--quantization int8 refused)",
        "decode attention": "native paged"
        + (" (AVX512-BF16 bodies for bfloat16)" if native and native.bf16_dot else "")
        if native
        else "torch SDPA over gathered blocks",
        "prefill attention": "native paged"
        + (" (AMX tiles for bfloat16)" if native and native.amx_prefill else "")
        if prefill
        else "torch SDPA per chunk",
        "norms, rotary, SiLU product, argmax": "native fused" if ops else "torch",
        "pure-decode steps": _decode_step(),
        "cuda": "reference backend (torch), CUDA graphs for pure-decode steps"
        if torch.cuda.is_available()
        else "no CUDA device",
    }


def _decode_step() -> str:
    lib = native_attention.library_with("decode_stack_available")
    dtypes = lib.decode_stack_available() if lib is not None else 0
    if not dtypes:
        return "the model's layer loop"
    names = ["float32"] + (["bfloat16"] if dtypes & 2 else [])
    return f"native decode stack ({', '.join(names)}); the layer loop otherwise"


def _bfloat16_linear() -> str:
    kind = linear_kind(torch.bfloat16)
    widened = ", bfloat16 widened to float32" if kind == "native-packed" else ""
    return LINEAR_KINDS[kind] + widened


def print_capabilities() -> None:
    choices = kernel_choices()
    width = max(map(len, choices))
    for op, kernel in choices.items():
        print(f"{op:<{width}}  {kernel}")
