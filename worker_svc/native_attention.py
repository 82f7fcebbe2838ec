"""The CPU paged decode kernel (worker_svc/csrc/paged_attention.c): build once, load, call.
The same library carries the packed GEMM (worker_svc/packed_gemm.py wraps it).

Built with the system C compiler on first use into `cache_dir()/kernels/` (a file named after a
hash of the source, the flags and the CPU's flags, so a change or another machine rebuilds), and
loaded with ctypes: plain pointers in, no torch headers, about a second to build. OpenMP comes
from the libgomp torch already loaded, so the kernel shares torch's threads. Where there is no
compiler, a portable build shipped with the package is used (worker_svc/kernel_build.py; the
worker image has one per x86-64 level); where there is neither, `load()` returns None and
attention keeps the torch path. `--kernels reference` (ModelRunnerConfig.kernels) never loads it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from pathlib import Path

import torch

from common.model_source import cache_dir
from worker_svc import cpu_caps, kernel_build

log = logging.getLogger("splitserve.worker.native_attention")

_I64, _F32 = ctypes.c_int64, ctypes.c_float
_P = ctypes.c_void_p
# q, k_cache, v_cache, block_table, its row stride, seq_lens, out, rows, heads, kv_heads,
# head_dim, block_size, scale, max_seq_len
_ARGTYPES = [_P, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _F32, _I64]
# q, k_cache, v_cache, block_table, its row stride, q_start, q_len, cached, chunks, out, heads,
# kv_heads, head_dim, block_size, scale
_PREFILL_ARGTYPES = [_P, _P, _P, _P, _I64, _P, _P, _P, _I64, _P] + [_I64] * 4 + [_F32]

_loaded: PagedDecodeKernel | None = None
_tried = False


class PagedDecodeKernel:
    """Attention over the paged cache: decode rows of one query token each, and (prefill())
    chunks of many, causal by position."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.lib, self.path = lib, path  # the library also holds the packed GEMM (packed_gemm.py)
        self._fns = {torch.float32: lib.paged_decode_f32, torch.bfloat16: lib.paged_decode_bf16}
        for fn in self._fns.values():
            fn.argtypes = _ARGTYPES
            fn.restype = ctypes.c_int
        self._prefill_fns = {}
        prefill_available = getattr(lib, "paged_prefill_available", None)
        if prefill_available is not None and prefill_available():
            self._prefill_fns = {
                torch.float32: lib.paged_prefill_f32,
                torch.bfloat16: lib.paged_prefill_bf16,
            }
            for fn in self._prefill_fns.values():
                fn.argtypes = _PREFILL_ARGTYPES
                fn.restype = ctypes.c_int
        # bfloat16 q and out straight in and out of the kernels (no float32 copies around the
        # call), where a body takes them: AVX512-BF16 decode, AMX prefill; -2 elsewhere
        self._io_fns = {}
        io_entries = {"paged_decode_bf16_io": _ARGTYPES}
        if self._prefill_fns:
            io_entries["paged_prefill_bf16_io"] = _PREFILL_ARGTYPES
        for name, argtypes in io_entries.items():
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
                self._io_fns[name] = fn
        self.bf16_dot = False  # the AVX512-BF16 decode bodies (bfloat16 caches)
        if getattr(lib, "paged_decode_set_bf16_dot", None) is not None:
            lib.paged_decode_set_bf16_dot.argtypes = [ctypes.c_int]
            lib.paged_decode_set_bf16_dot.restype = ctypes.c_int
            self.set_bf16_dot(True)
        self.amx_prefill = False  # bfloat16 prefill attention on AMX tiles (head_dim 64)
        if self._prefill_fns and getattr(lib, "paged_prefill_set_amx", None) is not None:
            lib.paged_prefill_set_amx.argtypes = [ctypes.c_int]
            lib.paged_prefill_set_amx.restype = ctypes.c_int
            self.set_amx_prefill(True)
        self._write_kv = lib.write_kv
        self._write_kv.argtypes = [_P, _P, _P, _P, _P] + [_I64] * 8
        self._write_kv.restype = ctypes.c_int

    @property
    def has_prefill(self) -> bool:
        """The library carries the prefill kernel (built for AVX-512)."""
        return bool(self._prefill_fns)

    def set_amx_prefill(self, on: bool) -> bool:
        """Prefill chunks over a bfloat16 cache (head_dim 64) on AMX tiles where the CPU has
        them (on from the start; off to compare): S = QK^T and O += PV as tile products, P
        rounded to bfloat16 for PV. Returns whether they are on."""
        fn = getattr(self.lib, "paged_prefill_set_amx", None)
        on = on and cpu_caps.capabilities().has("amx")
        self.amx_prefill = bool(fn(int(on))) if fn is not None else False
        return self.amx_prefill

    def set_bf16_dot(self, on: bool) -> bool:
        """Decode rows of a bfloat16 cache through AVX512-BF16 dot products (where the CPU has
        them; on from the start, off to compare): q.k on the cache's bfloat16 pairs as they are,
        in two passes (scores, one softmax per head, then V), P rounded to bfloat16 for P.V.
        Returns whether they are on."""
        fn = getattr(self.lib, "paged_decode_set_bf16_dot", None)
        on = on and cpu_caps.capabilities().has("avx512-bf16")
        self.bf16_dot = bool(fn(int(on))) if fn is not None else False
        return self.bf16_dot

    def write_kv(
        self,
        key: torch.Tensor,  # [kv_heads, T, head_dim], head_dim contiguous, the cache's dtype
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64, validated by the runner
    ) -> None:
        """index_copy_ of each new token's K/V into its slot, without the per-call overhead."""
        kv_heads, tokens, head_dim = key.shape
        if slot_mapping.numel() != tokens or value.shape != key.shape:
            raise ValueError(f"write_kv: {tokens} tokens, {slot_mapping.numel()} slots")
        self._write_kv(
            key.data_ptr(),
            value.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slot_mapping.data_ptr(),
            tokens,
            kv_heads,
            head_dim,
            key.element_size(),
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
        )

    def supports_prefill(
        self, cache: torch.Tensor, heads: int, kv_heads: int, head_dim: int
    ) -> bool:
        """The prefill kernel: AVX-512 build, head_dim a multiple of 16 up to 256, at most 8
        query heads per kv head (elsewhere SDPA per chunk)."""
        return (
            cache.dtype in self._prefill_fns
            and self.supports(cache)
            and head_dim % 16 == 0
            and head_dim <= 256
            and heads % kv_heads == 0
            and heads // kv_heads <= 8
        )

    def prefill(
        self,
        q: torch.Tensor,  # [tokens, heads, head_dim], contiguous: the chunks' queries
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,  # [chunks, >= max blocks] int64, contiguous
        q_start: torch.Tensor,  # [chunks] int64: first query token of each chunk in q
        q_len: torch.Tensor,  # [chunks] int64
        cached: torch.Tensor,  # [chunks] int64: tokens in the cache before each chunk
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of prefill chunks over their requests' cached and new K/V; q float32,
        or of the cache's dtype (the result then is too)."""
        _, heads, head_dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        fn = self._prefill_fns[k_cache.dtype]
        if q.dtype != torch.float32:
            fn = self._io_fns.get("paged_prefill_bf16_io") if q.dtype == k_cache.dtype else None
            if fn is None:
                return self.prefill(
                    q.float(), k_cache, v_cache, block_table, q_start, q_len, cached, scale
                ).to(q.dtype)
        out = torch.empty_like(q)
        rc = fn(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_table.data_ptr(),
            block_table.stride(0),
            q_start.data_ptr(),
            q_len.data_ptr(),
            cached.data_ptr(),
            q_len.numel(),
            out.data_ptr(),
            heads,
            kv_heads,
            head_dim,
            block_size,
            scale,
        )
        if rc == -2:  # no body takes bfloat16 q and out here
            return self.prefill(
                q.float(), k_cache, v_cache, block_table, q_start, q_len, cached, scale
            ).to(q.dtype)
        if rc != 0:
            raise MemoryError("paged prefill attention could not allocate its scratch buffers")
        return out

    def supports(self, cache: torch.Tensor) -> bool:
        return cache.device.type == "cpu" and cache.dtype in self._fns and cache.is_contiguous()

    def __call__(
        self,
        q: torch.Tensor,  # [rows, heads, head_dim], float32 or the cache's dtype, contiguous
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        block_table: torch.Tensor,  # [rows, >= max blocks] int64, contiguous
        seq_lens: torch.Tensor,  # [rows] int64
        max_seq_len: int,
        scale: float,
    ) -> torch.Tensor:
        rows, heads, head_dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        fn = self._fns[k_cache.dtype]
        if q.dtype != torch.float32:
            fn = self._io_fns.get("paged_decode_bf16_io") if q.dtype == k_cache.dtype else None
            if fn is None:
                return self(
                    q.float(), k_cache, v_cache, block_table, seq_lens, max_seq_len, scale
                ).to(q.dtype)
        out = torch.empty_like(q)
        rc = fn(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_table.data_ptr(),
            block_table.stride(0),
            seq_lens.data_ptr(),
            out.data_ptr(),
            rows,
            heads,
            kv_heads,
            head_dim,
            block_size,
            scale,
            max_seq_len,
        )
        if rc == -2:  # no body takes bfloat16 q and out here
            return self(q.float(), k_cache, v_cache, block_table, seq_lens, max_seq_len, scale).to(
                q.dtype
            )
        if rc != 0:
            raise MemoryError("paged decode attention could not allocate its scratch buffers")
        return out


def load() -> PagedDecodeKernel | None:
    """The kernel: built for this CPU if needed (or found built in the cache), else the best
    prebuilt portable one this CPU runs; None where there is neither (logged once)."""
    global _loaded, _tried
    if _tried:
        return _loaded
    _tried = True
    try:
        path = kernel_build.native_build(cache_dir() / "kernels")
    except (OSError, subprocess.CalledProcessError, RuntimeError) as exc:
        path = _prebuilt()
        if path is None:
            log.warning("native paged attention unavailable (%s); using the torch path", exc)
            return None
        log.info("no native build (%s); using the prebuilt %s", exc, path.name)
    try:
        _loaded = PagedDecodeKernel(ctypes.CDLL(str(path)), path)
    except OSError as exc:
        log.warning("native paged attention unavailable (%s); using the torch path", exc)
    return _loaded


def library_with(symbol: str) -> ctypes.CDLL | None:
    """The native library, for the other kernels it carries: None where it is unavailable or
    lacks `symbol`."""
    kernel = load()
    if kernel is None or not hasattr(kernel.lib, symbol):
        return None
    return kernel.lib


def _prebuilt() -> Path | None:
    """A portable library shipped beside the package (the worker image's, built on the host by
    docker/build-images.sh), or in $SPLITSERVE_PREBUILT_KERNELS."""
    directory = Path(os.environ.get("SPLITSERVE_PREBUILT_KERNELS") or kernel_build.PREBUILT_DIR)
    return kernel_build.find_prebuilt(directory, cpu_caps.capabilities())
