"""The packed GEMM of worker_svc/csrc/packed_gemm.c: pack a weight once, multiply often.
float32, and bfloat16 (weights widened to float32 in the kernel's inner loop: the bfloat16 path
of CPUs without bfloat16 arithmetic).

The kernel lives in the same native library as the paged attention (native_attention.load()
builds or finds it); it needs AVX2 + FMA (AVX-512 where the library is built for it), and
`load()` returns None where the library or that path is missing (or SPLITSERVE_NATIVE_GEMM=0),
so callers keep torch's linear.
"""

from __future__ import annotations

import contextlib
import ctypes

import torch
from torch.autograd import profiler

from worker_svc import native_attention

_I64, _P = ctypes.c_int64, ctypes.c_void_p
PROFILE_NAME = "splitserve::packed_sgemm"  # what the torch profiler shows for a call
DTYPES = (torch.float32, torch.bfloat16)
_NO_RANGE = contextlib.nullcontext()


def profiled_range(name: str):
    """A named torch profiler range around a native call, only while the profiler runs
    (record_function costs a dispatch per call otherwise)."""
    return torch.profiler.record_function(name) if profiler._is_profiler_enabled else _NO_RANGE  # noqa: SLF001


class PackedGemm:
    def __init__(self, lib: ctypes.CDLL, panel_width: int) -> None:
        self.panel_width = panel_width
        self._fns = {torch.float32: lib.packed_sgemm, torch.bfloat16: lib.packed_bgemm}
        for fn in self._fns.values():
            # x, M, K, lda, packed, N, bias, y, ldy, threads
            fn.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I64]
            fn.restype = ctypes.c_int
        self._elapsed = lib.packed_sgemm_elapsed_ns
        self._elapsed.restype = ctypes.c_int64

    def elapsed_s(self) -> float:
        """Wall time spent in the kernel since the library loaded (every caller in the process)."""
        return self._elapsed() / 1e9

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[out, in] (nn.Linear's layout) -> [panels, in, panel_width], zero-padded, same dtype."""
        out_features, in_features = weight.shape
        width = self.panel_width
        panels = -(-out_features // width)
        padded = weight.new_zeros(panels * width, in_features)
        padded[:out_features] = weight
        return padded.view(panels, width, in_features).transpose(1, 2).contiguous()

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [..., in] in the packed weight's dtype -> [..., out_features]."""
        in_features = packed.shape[1]
        flat = x.reshape(-1, in_features)
        if flat.stride(-1) != 1 or flat.dtype != packed.dtype or flat.dtype not in self._fns:
            raise ValueError(
                f"the packed GEMM takes {packed.dtype} rows with contiguous features "
                f"(float32 or bfloat16), not {flat.dtype}"
            )
        rows = flat.shape[0]
        out = torch.empty(rows, out_features, dtype=flat.dtype)
        if rows:
            with profiled_range(PROFILE_NAME):
                self._run(flat, packed, out, bias)
        return out.view(*x.shape[:-1], out_features)

    def _run(self, flat, packed, out, bias) -> None:
        self._fns[flat.dtype](
            flat.data_ptr(),
            flat.shape[0],
            flat.shape[1],
            flat.stride(0),
            packed.data_ptr(),
            out.shape[1],
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
        )


def load() -> PackedGemm | None:
    """None where SPLITSERVE_NATIVE_GEMM=0 (to compare with MKL), or the kernel is missing."""
    lib = native_attention.library_with("packed_sgemm_panel_width", "SPLITSERVE_NATIVE_GEMM")
    if lib is None:
        return None
    width = int(lib.packed_sgemm_panel_width())
    return PackedGemm(lib, width) if width > 0 else None
