"""One-pass float32 RMSNorm and SiLU-gated MLP product for the CPU forward (worker_svc/csrc/
fused_ops.c), swapped into the stock Hugging Face model as modules, as fast_linear does for the
linears: the decoder layer's own forward code is untouched.

Swapped only where the math is known to be the same: the RMSNorm and MLP classes listed below
(Llama's formulas; Gemma's `1 + weight` norm, for one, is not among them), float32, on the CPU,
with the native library built with AVX-512. `SPLITSERVE_FUSED_OPS=0` keeps torch's ops.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch
from torch import nn
from torch.autograd import profiler

from worker_svc import native_attention

log = logging.getLogger("splitserve.worker.fused_ops")

_I64, _P = ctypes.c_int64, ctypes.c_void_p
RMS_NORM_CLASSES = frozenset(
    {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm"}
)
GATED_MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
SILU_CLASSES = frozenset({"SiLU", "SiLUActivation"})


class FusedOps:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._rms_norm = lib.rms_norm_f32
        self._rms_norm.argtypes = [_P, _I64, _I64, _I64, _P, ctypes.c_float, _P, _I64, _I64]
        self._rms_norm.restype = ctypes.c_int
        self._silu_mul = lib.silu_mul_f32
        self._silu_mul.argtypes = [_P, _P, _P, _I64, _I64]
        self._silu_mul.restype = ctypes.c_int

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dim = x.shape[-1]
        flat = x.reshape(-1, dim)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        out = torch.empty(flat.shape, dtype=torch.float32)
        with _named("splitserve::rms_norm"):
            self._rms_norm(
                flat.data_ptr(), flat.shape[0], dim, flat.stride(0), weight.data_ptr(), eps,
                out.data_ptr(), dim, torch.get_num_threads(),
            )  # fmt: skip
        return out.view(x.shape)

    def silu_mul_(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate <- silu(gate) * up (both contiguous, same shape); returns gate."""
        with _named("splitserve::silu_mul"):
            self._silu_mul(
                gate.data_ptr(), up.data_ptr(), gate.data_ptr(), gate.numel(),
                torch.get_num_threads(),
            )  # fmt: skip
        return gate


class _Unnamed:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


_UNNAMED = _Unnamed()


def _named(name: str):
    """A profiler range only while the profiler runs (record_function costs a dispatch)."""
    return torch.profiler.record_function(name) if profiler._is_profiler_enabled else _UNNAMED  # noqa: SLF001


class NativeRMSNorm(nn.Module):
    def __init__(self, norm: nn.Module, ops: FusedOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(norm.weight.detach().float().contiguous(), requires_grad=False)
        self.variance_epsilon = float(norm.variance_epsilon)
        self._ops = ops

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)


class NativeGatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), the product in one pass, in place in gate's output."""

    def __init__(self, mlp: nn.Module, ops: FusedOps) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self._ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x).contiguous(), self.up_proj(x).contiguous()
        return self.down_proj(self._ops.silu_mul_(gate, up))


def load() -> FusedOps | None:
    if os.environ.get("SPLITSERVE_FUSED_OPS", "1") == "0":
        return None
    kernel = native_attention.load()
    if kernel is None or not hasattr(kernel.lib, "rms_norm_f32"):
        return None
    probe = torch.ones(1, 16)
    ops = FusedOps(kernel.lib)
    rc = ops._rms_norm(probe.data_ptr(), 1, 16, 16, probe.data_ptr(), 0.0, probe.data_ptr(), 16, 1)
    return ops if rc == 0 else None  # -1: built without AVX-512


def fuse_elementwise(model: nn.Module) -> int:
    """Swap the known RMSNorm and SiLU-gated MLP modules (float32, CPU); returns how many."""
    if next(model.parameters()).dtype != torch.float32:
        return 0
    ops = load()
    if ops is None:
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            kind = type(child).__name__
            if kind in RMS_NORM_CLASSES and hasattr(child, "variance_epsilon"):
                setattr(parent, name, NativeRMSNorm(child, ops))
            elif kind in GATED_MLP_CLASSES and type(getattr(child, "act_fn", None)).__name__ in (
                SILU_CLASSES
            ):
                setattr(parent, name, NativeGatedMLP(child, ops))
            else:
                continue
            swapped += 1
    log.info("%d norm and MLP modules now native", swapped)
    return swapped
