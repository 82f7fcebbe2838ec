"""Keep freed host memory inside the worker instead of handing it back to the kernel.

glibc serves allocations above its mmap threshold (128 KiB at start, raised on its own to at
most 32 MiB) with fresh mmap'd pages, and trims the top of the heap back to the kernel: then
every large activation of a prefill step (q/k/v, the MLP's 1,536-wide products: several MiB
per layer at 2,000 tokens) is page-faulted in again, 4 KiB at a time, on every step, a large
part of a prefill step's time. A forward pass allocates the same sizes step after step, so the
heap keeping and reusing its pages costs nothing more than the peak the worker reaches anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("splitserve.worker.host_memory")

M_TRIM_THRESHOLD = -1  # glibc malloc.h
M_MMAP_THRESHOLD = -3
# Older glibc refuses mmap thresholds above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit): fall back.
MMAP_THRESHOLDS = (1 << 30, 32 << 20)
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int

_applied: int | None = None


def keep_freed_memory() -> int | None:
    """Raise glibc's mmap and trim thresholds (once per process). Returns the mmap threshold
    now in force, or None where this is not glibc (musl, macOS) or it refused."""
    global _applied
    if _applied is not None:
        return _applied
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    for threshold in MMAP_THRESHOLDS:
        if mallopt(M_MMAP_THRESHOLD, threshold) == 1:
            mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
            _applied = threshold
            log.debug("malloc keeps freed memory below %d bytes per allocation", threshold)
            return threshold
    return None
