"""The native grouped low-rank product (worker_svc/csrc/lora.c), for the native backend: one
call per site per layer for every token of the step that runs an adapter. `load()` is None
where the native library is missing or predates the kernel; the torch product (lora_ops.py)
runs then.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from worker_svc import native_attention
from worker_svc.lora.adapter_slots import SiteSlots
from worker_svc.lora.step_lora import StepLora
from worker_svc.packed_gemm import profiled_range

_I64, _P = ctypes.c_int64, ctypes.c_void_p
DTYPES = (torch.float32, torch.bfloat16)


class LoraKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.lora_add
        # bf16, x, in, ldx, tokens, slots, n, a, max_rank, parts, b, widths, scale, rank,
        # out, ldo, threads
        self._fn.argtypes = [ctypes.c_int, _P, _I64, _I64, _P, _P, _I64, _P, _I64, _I64]
        self._fn.argtypes += [_P, _P, _P, _P, _P, _P, _I64]
        self._fn.restype = ctypes.c_int

    @staticmethod
    def takes(x: torch.Tensor, outs: tuple[torch.Tensor, ...]) -> bool:
        return (
            x.dtype in DTYPES
            and x.device.type == "cpu"
            and all(o.dtype == x.dtype and o.stride(-1) == 1 for o in outs)
        )

    def add_(
        self, x: torch.Tensor, outs: tuple[torch.Tensor, ...], site: SiteSlots, step: StepLora
    ) -> None:
        """As lora_ops.add_lora_, for CPU float32 / bfloat16 rows (the caller checks `takes`)."""
        tokens, slots = step.by_slot()
        if not len(tokens):
            return
        if x.stride(-1) != 1:
            x = x.contiguous()
        out_pointers = np.array([o.data_ptr() for o in outs], dtype=np.int64)
        out_strides = np.array([o.stride(0) for o in outs], dtype=np.int64)
        with profiled_range("splitserve::lora_add"):
            rc = self._fn(
                x.dtype == torch.bfloat16,
                x.data_ptr(),
                x.shape[1],
                x.stride(0),
                tokens.data_ptr(),
                slots.data_ptr(),
                len(tokens),
                site.a.data_ptr(),
                site.max_rank,
                len(outs),
                site.b_pointers.ctypes.data,
                site.widths.ctypes.data,
                site.scale.data_ptr(),
                site.rank.data_ptr(),
                out_pointers.ctypes.data,
                out_strides.ctypes.data,
                torch.get_num_threads(),
            )
        if rc:
            raise MemoryError("the native LoRA kernel could not allocate its row buffers")


_loaded: LoraKernel | None = None
_tried = False


def load() -> LoraKernel | None:
    global _loaded, _tried
    if not _tried:
        _tried = True
        lib = native_attention.library_with("lora_add")
        _loaded = None if lib is None else LoraKernel(lib)
    return _loaded
