"""The native elementwise kernels (worker_svc/csrc/fused_ops.c): RMSNorm, residual add and
RMSNorm in one pass, rotary, the SiLU-gated product and a row-wise argmax, float32 and bfloat16
(rounded where torch's bfloat16 ops round). The native backend (worker_svc/ops/native.py) calls
them; the library has them at the avx2 level and up (fused_ops.c for AVX-512, fused_ops_avx2.c
for AVX2 + FMA); below that the reference ops run.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from worker_svc import native_attention
from worker_svc.packed_gemm import profiled_range

log = logging.getLogger("splitserve.worker.fused_ops")

_I64, _P = ctypes.c_int64, ctypes.c_void_p
DTYPES = (torch.float32, torch.bfloat16)
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


class FusedOps:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._rms_norms, self._silu_muls, self._rotaries, self._argmaxes = {}, {}, {}, {}
        self._add_rms_norms = {}
        for dtype, suffix in _SUFFIX.items():
            norm = getattr(lib, f"rms_norm_{suffix}")
            norm.argtypes = [_P, _I64, _I64, _I64, _P, ctypes.c_float, _P, _I64, _I64]
            norm.restype = ctypes.c_int
            silu_mul = getattr(lib, f"silu_mul_{suffix}")
            silu_mul.argtypes = [_P, _P, _P, _I64, _I64]
            silu_mul.restype = ctypes.c_int
            self._rms_norms[dtype], self._silu_muls[dtype] = norm, silu_mul
            add_norm = getattr(lib, f"add_rms_norm_{suffix}")
            add_norm.argtypes = [_P, _P, _I64, _I64, _I64, _I64, _P, ctypes.c_float, _P, _I64, _I64]
            add_norm.restype = ctypes.c_int
            self._add_rms_norms[dtype] = add_norm
            rotary = getattr(lib, f"rotary_{suffix}")
            rotary.argtypes = [_P, _P, *[_I64] * 7, _P, _P, _I64, _I64]
            rotary.restype = ctypes.c_int
            self._rotaries[dtype] = rotary
            argmax = getattr(lib, f"argmax_{suffix}")
            argmax.argtypes = [_P, _I64, _I64, _I64, _P, _I64]
            argmax.restype = ctypes.c_int
            self._argmaxes[dtype] = argmax

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x and weight of one dtype in DTYPES (the caller checks)."""
        dim = x.shape[-1]
        flat = x.reshape(-1, dim)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        out = torch.empty(flat.shape, dtype=x.dtype)
        with profiled_range("splitserve::rms_norm"):
            self._rms_norms[x.dtype](
                flat.data_ptr(),
                flat.shape[0],
                dim,
                flat.stride(0),
                weight.data_ptr(),
                eps,
                out.data_ptr(),
                dim,
                torch.get_num_threads(),
            )
        return out.view(x.shape)

    def add_rms_norm_(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """x += delta in place (rounded to x's dtype, as torch's add), then the RMSNorm of x:
        a decoder layer's residual add and the next norm in one pass. x [rows, dim] with
        contiguous features, delta the same shape and dtype (the caller checks)."""
        out = torch.empty(x.shape, dtype=x.dtype)
        with profiled_range("splitserve::add_rms_norm"):
            self._add_rms_norms[x.dtype](
                x.data_ptr(),
                delta.data_ptr(),
                x.shape[0],
                x.shape[1],
                x.stride(0),
                delta.stride(0),
                weight.data_ptr(),
                eps,
                out.data_ptr(),
                x.shape[1],
                torch.get_num_threads(),
            )
        return out

    def silu_mul_(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate <- silu(gate) * up (both contiguous, same shape); returns gate."""
        with profiled_range("splitserve::silu_mul"):
            self._silu_muls[gate.dtype](
                gate.data_ptr(),
                up.data_ptr(),
                gate.data_ptr(),
                gate.numel(),
                torch.get_num_threads(),
            )
        return gate

    def argmax(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Row-wise first index of the maximum of [rows, vocab] logits (float32 or bfloat16,
        CPU, unit column stride), as torch.max(dim=-1).indices; None when the kernel does not
        apply or a row holds a NaN (torch's ranking of NaN is left to torch)."""
        if (
            logits.dim() != 2
            or logits.dtype not in self._argmaxes
            or logits.device.type != "cpu"
            or logits.stride(-1) != 1
        ):
            return None
        rows, cols = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        with profiled_range("splitserve::argmax"):
            rc = self._argmaxes[logits.dtype](
                logits.data_ptr(),
                rows,
                cols,
                logits.stride(0),
                out.data_ptr(),
                torch.get_num_threads(),
            )
        return out if rc == 0 else None

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [1, heads, T, head_dim] (any strides, head_dim contiguous) rotated by cos/sin
        [1, T, head_dim]; the result laid out [T, heads, head_dim] in memory (as the
        projections' views are), in x's shape."""
        _, heads, tokens, head_dim = x.shape
        out = torch.empty((1, tokens, heads, head_dim), dtype=x.dtype).transpose(1, 2)
        with profiled_range("splitserve::rotary"):
            self._rotaries[x.dtype](
                x.data_ptr(),
                out.data_ptr(),
                tokens,
                heads,
                head_dim,
                x.stride(2),
                x.stride(1),
                out.stride(2),
                out.stride(1),
                cos.data_ptr(),
                sin.data_ptr(),
                cos.stride(1),
                torch.get_num_threads(),
            )
        return out


def load() -> FusedOps | None:
    lib = native_attention.library_with("fused_ops_available")
    return FusedOps(lib) if lib is not None and lib.fused_ops_available() else None
