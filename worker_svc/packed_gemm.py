"""The packed GEMM of worker_svc/csrc/packed_gemm.c: pack a weight once, multiply often.
float32, bfloat16 (weights widened to float32 in the kernel's inner loop: the bfloat16 path
of CPUs without bfloat16 arithmetic), and int8 weights with a float32 scale per output column
(worker_svc/quantization.py) under float32 or bfloat16 activations.

The kernel lives in the same native library as the paged attention (native_attention.load()
builds or finds it); it needs AVX2 + FMA (AVX-512 where the library is built for it), and
`load()` returns None where the library or that path is missing, so callers keep torch's
linear.
"""

from __future__ import annotations

import contextlib
import ctypes

import torch
from torch.autograd import profiler

from worker_svc import native_attention

_I64, _P = ctypes.c_int64, ctypes.c_void_p
PROFILE_NAME = "splitserve::packed_sgemm"  # what the torch profiler shows for a call
DTYPES = (torch.float32, torch.bfloat16)  # of the activations (and of the weights but int8)
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
        # activations' dtype -> the int8-weight entry; empty in a library built before it
        self._int8_fns = {}
        if hasattr(lib, "packed_i8gemm"):
            self._int8_fns = {torch.float32: lib.packed_i8gemm, torch.bfloat16: lib.packed_i8bgemm}
        for fn in self._int8_fns.values():
            # x, M, K, lda, packed, N, scale, bias, y, ldy, threads
            fn.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _I64, _I64]
            fn.restype = ctypes.c_int
        self._elapsed = lib.packed_sgemm_elapsed_ns
        self._elapsed.restype = ctypes.c_int64

    def elapsed_s(self) -> float:
        """Wall time spent in the kernel since the library loaded (every caller in the process)."""
        return self._elapsed() / 1e9

    @property
    def has_int8(self) -> bool:
        return bool(self._int8_fns)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[out, in] (nn.Linear's layout) -> [panels, in, panel_width], zero-padded, same dtype
        (int8 for quantized weights)."""
        out_features, in_features = weight.shape
        width = self.panel_width
        panels = -(-out_features // width)
        padded = weight.new_zeros(panels * width, in_features)
        padded[:out_features] = weight
        return padded.view(panels, width, in_features).transpose(1, 2).contiguous()

    def __call__(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None,
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [..., in] in the packed weight's dtype (or float32 / bfloat16 over an int8 weight
        with its float32 `scale` [out_features]; bias in x's dtype) -> [..., out_features]."""
        in_features = packed.shape[1]
        flat = x.reshape(-1, in_features)
        int8 = packed.dtype == torch.int8
        fns = self._int8_fns if int8 else self._fns
        if (
            flat.stride(-1) != 1
            or flat.dtype not in fns
            or (not int8 and flat.dtype != packed.dtype)
            or int8 != (scale is not None)
        ):
            raise ValueError(
                f"the packed GEMM takes float32 or bfloat16 rows with contiguous features over "
                f"a weight of their dtype or int8 with scales, not {flat.dtype} over {packed.dtype}"
            )
        rows = flat.shape[0]
        out = torch.empty(rows, out_features, dtype=flat.dtype)
        if rows:
            with profiled_range(PROFILE_NAME):
                fns[flat.dtype](
                    flat.data_ptr(),
                    rows,
                    in_features,
                    flat.stride(0),
                    packed.data_ptr(),
                    out_features,
                    *((scale.data_ptr(),) if int8 else ()),
                    None if bias is None else bias.data_ptr(),
                    out.data_ptr(),
                    out.stride(0),
                    torch.get_num_threads(),
                )
        return out.view(*x.shape[:-1], out_features)


def load() -> PackedGemm | None:
    """None where the library or the kernel is missing."""
    lib = native_attention.library_with("packed_sgemm_panel_width")
    if lib is None:
        return None
    width = int(lib.packed_sgemm_panel_width())
    return PackedGemm(lib, width) if width > 0 else None
