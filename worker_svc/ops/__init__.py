"""The table of ops the model implementation (worker_svc.model) is written over, and its backends.

    ops = select_ops(device, dtype, kernels="native", quantization="none")

Ops: linear (and q/k/v as one GEMM, the SiLU-gated product), RMSNorm, residual add + RMSNorm,
rotary, paged attention (worker_svc.attention, with the backend's kernel), argmax for greedy
sampling. `reference` is plain torch on any device; `native` is the CPU kernels of this
machine's level (worker_svc/csrc), each op falling back to the reference one where its kernel is
missing. A CUDA worker runs the reference backend (its GEMMs and SDPA are CUDA's own).
"""

from __future__ import annotations

import torch

from worker_svc import quantization
from worker_svc.ops.native import NativeOps
from worker_svc.ops.reference import ReferenceOps

KERNELS = ("reference", "native")


def select_ops(
    device: torch.device, dtype: torch.dtype, kernels: str, quantization_method: str = "none"
) -> ReferenceOps:
    """The backend for a worker; raises quantization.Unsupported (one sentence) where the
    quantization cannot run with these kernels on this device."""
    if kernels not in KERNELS:
        raise ValueError(f"unknown kernels {kernels!r}; one of {', '.join(KERNELS)}")
    quantization.check_supported(quantization_method, device, dtype, kernels)
    if kernels == "native" and device.type == "cpu":
        return NativeOps(dtype, quantization_method)
    return ReferenceOps(device, dtype)


__all__ = ["KERNELS", "NativeOps", "ReferenceOps", "select_ops"]
