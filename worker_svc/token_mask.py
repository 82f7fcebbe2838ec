"""Grammar masks applied straight from their packed words (worker_svc/csrc/token_mask.c): the
CPU sampler's path for structured output where the native library is built."""

from __future__ import annotations

import ctypes

import torch

from worker_svc import native_attention

_I64, _P = ctypes.c_int64, ctypes.c_void_p


class PackedMask:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._apply = lib.apply_packed_mask_f32
        self._apply.argtypes = [_P, _I64, _I64, _P, _I64, _P, _I64, _I64]
        self._apply.restype = ctypes.c_int

    def __call__(self, logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor) -> bool:
        """In place on float32 CPU logits [R, V]: row rows[i] keeps only what masks[i] (int32
        [C, words]) allows. False (nothing done) where the tensors do not fit the kernel."""
        if (
            logits.dtype != torch.float32
            or logits.device.type != "cpu"
            or logits.dim() != 2
            or logits.stride(1) != 1
            or rows.dtype != torch.int64
            or masks.dtype != torch.int32
            or not rows.is_contiguous()
            or not masks.is_contiguous()
        ):
            return False
        self._apply(
            logits.data_ptr(),
            logits.stride(0),
            logits.shape[1],
            rows.data_ptr(),
            len(rows),
            masks.data_ptr(),
            masks.shape[1],
            torch.get_num_threads(),
        )
        return True


def load() -> PackedMask | None:
    lib = native_attention.library_with("apply_packed_mask_f32")
    return PackedMask(lib) if lib is not None else None
