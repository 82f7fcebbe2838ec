"""The AMX bfloat16 GEMM of worker_svc/csrc/amx_gemm.c: pack a weight once into tile order,
multiply decode-sized inputs often.

In the same native library as the other CPU kernels; it needs a CPU with AMX-BF16 and a kernel
that grants the process the tile registers, and `load()` returns None otherwise, so callers
keep oneDNN.
"""

from __future__ import annotations

import ctypes

import torch

from worker_svc import cpu_caps, native_attention
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
        return self._multiply(
            x,
            packed,
            out_features,
            lambda flat, out: self._gate_up(
                flat.data_ptr(),
                flat.shape[0],
                flat.shape[1],
                flat.stride(0),
                packed.data_ptr(),
                out_features,
                out.data_ptr(),
                out_features,
                torch.get_num_threads(),
            ),
        )

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [..., in] bfloat16 -> [..., out_features] bfloat16."""
        bias_ptr = None if bias is None else bias.data_ptr()
        return self._multiply(
            x,
            packed,
            out_features,
            lambda flat, out: self._fn(
                flat.data_ptr(),
                flat.shape[0],
                flat.shape[1],
                flat.stride(0),
                packed.data_ptr(),
                out_features,
                bias_ptr,
                out.data_ptr(),
                out_features,
                torch.get_num_threads(),
            ),
        )

    @staticmethod
    def _multiply(x: torch.Tensor, packed: torch.Tensor, out_features: int, kernel) -> torch.Tensor:
        """x's rows as a [rows, in] view, a fresh [rows, out_features] output, `kernel(flat,
        out)` (a C entry's status) between them."""
        flat = x.reshape(-1, packed.shape[1] * 32)
        if flat.stride(-1) != 1 or flat.dtype != torch.bfloat16:
            raise ValueError("the AMX GEMM takes bfloat16 rows with contiguous features")
        out = torch.empty(flat.shape[0], out_features, dtype=torch.bfloat16)
        if flat.shape[0]:
            with profiled_range(PROFILE_NAME):
                rc = kernel(flat, out)
            if rc != 0:
                raise RuntimeError("the AMX GEMM refused its arguments")
        return out.view(*x.shape[:-1], out_features)


def load() -> AmxGemm | None:
    if not cpu_caps.capabilities().has("amx"):
        return None
    lib = native_attention.library_with("amx_gemm_available")
    return AmxGemm(lib) if lib is not None and lib.amx_gemm_available() else None
