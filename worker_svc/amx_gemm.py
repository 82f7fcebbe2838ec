"""The AMX bfloat16 GEMM of worker_svc/csrc/amx_gemm.c: pack a weight once into tile order,
multiply decode-sized inputs often.

In the same native library as the other CPU kernels; it needs a CPU with AMX-BF16 and a kernel
that grants the process the tile registers, and `load()` returns None otherwise (or with
SPLITSERVE_AMX_GEMM=0), so callers keep oneDNN.
"""

from __future__ import annotations

import ctypes

import torch

from worker_svc import native_attention
from worker_svc.packed_gemm import profiled_range

_I64, _P = ctypes.c_int64, ctypes.c_void_p
PROFILE_NAME = "splitserve::amx_gemm"


class AmxGemm:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.amx_gemm_bf16
        # x, M, K, lda, packed, N, bias, y, ldy, threads
        self._fn.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I64]
        self._fn.restype = ctypes.c_int
        self._gate_up = lib.amx_gemm_bf16_silu_mul
        # x, M, K, lda, packed, N, y, ldy, threads
        self._gate_up.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _P, _I64, _I64]
        self._gate_up.restype = ctypes.c_int

    @staticmethod
    def supports(in_features: int, out_features: int) -> bool:
        """Whole tiles only: K a multiple of 32, N of 32 (two 16-column panels at a time)."""
        return in_features % 32 == 0 and out_features % 32 == 0

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """[out, in] bfloat16 (nn.Linear's layout) -> [out / 16, in / 32, 16, 16, 2]: per panel
        of 16 output columns and 32-deep slice of K, one B tile (K pairs x columns x pair)."""
        n, k = weight.shape
        tiles = weight.to(torch.bfloat16).reshape(n // 16, 16, k // 32, 16, 2)
        return tiles.permute(0, 2, 3, 1, 4).contiguous()

    @classmethod
    def pack_gate_up(cls, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """Two [out, in] weights -> one packed weight of 2 * out columns in panel pairs (16 gate
        columns, then the same 16 of up), for gate_up_silu()."""
        n, k = gate.shape
        pairs = torch.stack([gate.reshape(n // 16, 16, k), up.reshape(n // 16, 16, k)], dim=1)
        return cls.pack(pairs.reshape(2 * n, k))

    def gate_up_silu(
        self, x: torch.Tensor, packed: torch.Tensor, out_features: int
    ) -> torch.Tensor:
        """silu(x @ gate^T) * (x @ up^T), x [..., in] bfloat16, rounded where torch rounds."""
        in_features = packed.shape[1] * 32
        flat = x.reshape(-1, in_features)
        if flat.stride(-1) != 1 or flat.dtype != torch.bfloat16:
            raise ValueError("amx_gemm_bf16_silu_mul takes bfloat16 rows with contiguous features")
        rows = flat.shape[0]
        out = torch.empty(rows, out_features, dtype=torch.bfloat16)
        if rows:
            with profiled_range(PROFILE_NAME):
                rc = self._gate_up(
                    flat.data_ptr(), rows, in_features, flat.stride(0), packed.data_ptr(),
                    out_features, out.data_ptr(), out_features, torch.get_num_threads(),
                )  # fmt: skip
            if rc != 0:
                raise RuntimeError("amx_gemm_bf16_silu_mul refused its arguments")
        return out.view(*x.shape[:-1], out_features)

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [..., in] bfloat16 -> [..., out_features] bfloat16."""
        in_features = packed.shape[1] * 32
        flat = x.reshape(-1, in_features)
        if flat.stride(-1) != 1 or flat.dtype != torch.bfloat16:
            raise ValueError("amx_gemm_bf16 takes bfloat16 rows with contiguous features")
        rows = flat.shape[0]
        out = torch.empty(rows, out_features, dtype=torch.bfloat16)
        if rows:
            with profiled_range(PROFILE_NAME):
                rc = self._fn(
                    flat.data_ptr(), rows, in_features, flat.stride(0), packed.data_ptr(),
                    out_features, None if bias is None else bias.data_ptr(), out.data_ptr(),
                    out_features, torch.get_num_threads(),
                )  # fmt: skip
            if rc != 0:
                raise RuntimeError("amx_gemm_bf16 refused its arguments")
        return out.view(*x.shape[:-1], out_features)


def load() -> AmxGemm | None:
    lib = native_attention.library_with("amx_gemm_available", "SPLITSERVE_AMX_GEMM")
    return AmxGemm(lib) if lib is not None and lib.amx_gemm_available() else None
