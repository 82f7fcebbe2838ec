"""A bfloat16 decoder's layers for a pure-decode step in one native call (csrc/decode_stack.c).

The runner's layer loop (decoder_loop.py) spends ~140 us of Python per layer at decode sizes
(module calls, views, allocations, ctypes calls); the kernels it calls release the GIL, but the
second OpenMP thread can only wait through that Python, ~5 ms of a 40 ms batch-64 step on two
cores. Here the same kernels run in the same order with the same arguments from C, so the
result is the loop's bits (tested against it), for the steps where every row decodes, in
bfloat16 with every layer on the AMX GEMMs, the native rotary and the native decode attention.
Any other step, or `SPLITSERVE_DECODE_STACK=0`, keeps the Python loop.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from worker_svc import native_attention
from worker_svc.fast_linear import AMX_MAX_ROWS, AmxLinear
from worker_svc.fused_ops import NativeGatedMLP, NativeRotary

if TYPE_CHECKING:
    from worker_svc.decoder_loop import DecoderLoop

log = logging.getLogger("splitserve.worker.decode_stack")

_I64, _P, _F = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class DecodeStack:
    def __init__(self, lib: ctypes.CDLL, loop: DecoderLoop, layer_ptrs: np.ndarray) -> None:
        self._fn = lib.decode_stack_bf16
        self._fn.argtypes = [_P, _P, _I64, _P, *[_I64] * 6, _P, _P, _I64, _P, _P, _I64, _P,
                             _I64, _I64, _F, _P, _F, _P, _P, _I64]  # fmt: skip
        self._fn.restype = ctypes.c_int
        self._scratch_elems = lib.decode_stack_scratch_elems
        self._scratch_elems.argtypes = [_I64] * 6
        self._scratch_elems.restype = _I64
        self.loop = loop
        first = loop.layers[0]
        self.hidden = first.input_norm.weight.shape[0]
        self.head_dim = first.head_dim
        self.intermediate = first.mlp.gate_proj.out_features
        self.scale = float(first.attn.scaling)
        self.layer_idx = [layer.attn.layer_idx for layer in loop.layers]
        self.layer_ptrs = layer_ptrs  # [layers, 11]: weights; the cache columns set per call
        self.eps = np.array(
            [(la.input_norm.variance_epsilon, la.post_norm.variance_epsilon) for la in loop.layers],
            dtype=np.float32,
        ).reshape(-1)
        self.final_norm = loop.inner.norm
        self.enabled = os.environ.get("SPLITSERVE_DECODE_STACK", "1") != "0"

    def applies(self, x: torch.Tensor, cos: torch.Tensor, meta) -> bool:
        tokens = x.shape[0]
        return (
            self.enabled
            and 0 < tokens <= AMX_MAX_ROWS
            and meta.num_native_decodes == tokens
            and meta.prefill_q_len is None
            and not meta.groups
            and x.dtype == torch.bfloat16
            and x.is_contiguous()
            and cos.dtype == torch.bfloat16
            and cos.shape == (1, tokens, self.head_dim)
            and cos.stride(-1) == 1
            and isinstance(self.loop._rotary_module.apply_rotary_pos_emb, NativeRotary)  # noqa: SLF001
            and self.loop._rotary_module.apply_rotary_pos_emb.enabled  # noqa: SLF001
        )

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta):
        """The final norm's output [T, hidden] (x, the residual stream, changes in place), or
        None where the attention has no bfloat16 body on this CPU (x unchanged; the caller runs
        its loop, and this stack stays off)."""
        loop, tokens = self.loop, x.shape[0]
        ptrs = self.layer_ptrs
        ptrs[:, 9] = [meta.key_caches[i].data_ptr() for i in self.layer_idx]
        ptrs[:, 10] = [meta.value_caches[i].data_ptr() for i in self.layer_idx]
        dims = (tokens, self.hidden, loop.num_heads, loop.num_kv_heads, self.head_dim,
                self.intermediate)  # fmt: skip
        scratch = torch.empty(self._scratch_elems(*dims), dtype=torch.bfloat16)
        out = torch.empty(tokens, self.hidden, dtype=torch.bfloat16)
        table = meta.decode_block_table
        rc = self._fn(
            ptrs.ctypes.data, self.eps.ctypes.data, len(self.layer_idx), x.data_ptr(), *dims,
            cos.data_ptr(), sin.data_ptr(), cos.stride(1), meta.slot_mapping.data_ptr(),
            table.data_ptr(), table.stride(0), meta.decode_seq_lens.data_ptr(),
            meta.decode_max_len, meta.block_size, self.scale, self.final_norm.weight.data_ptr(),
            self.final_norm.variance_epsilon, out.data_ptr(), scratch.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if rc == -2:
            log.info("no bfloat16 decode attention body on this CPU: the Python layer loop")
            self.enabled = False
            return None
        if rc != 0:
            raise RuntimeError("the native decode stack failed (a kernel refused or no memory)")
        return out


def build(loop: DecoderLoop) -> DecodeStack | None:
    """The stack for `loop` where every layer runs on the kernels it calls, else None."""
    lib = native_attention.library_with("decode_stack_available", "SPLITSERVE_DECODE_STACK")
    if lib is None or not lib.decode_stack_available():
        return None
    if not loop.layers or loop.inner.norm.weight.dtype != torch.bfloat16:
        return None
    rows, scales = [], set()
    for layer in loop.layers:
        a, mlp = layer.attn, layer.mlp
        linears_packed = all(
            isinstance(p, AmxLinear) and p.packed_weight is not None
            for p in (a.o_proj, getattr(mlp, "down_proj", None))
        )
        if (
            layer.qkv is None
            or not linears_packed
            or not isinstance(mlp, NativeGatedMLP)
            or mlp._amx is None  # noqa: SLF001
            or layer.head_dim % 32
            or getattr(a, "layer_idx", None) is None
            or layer.input_norm.weight.dtype != torch.bfloat16
            or layer.post_norm.weight.dtype != torch.bfloat16
        ):
            return None
        scales.add(float(a.scaling))
        rows.append(
            [
                layer.input_norm.weight.data_ptr(),
                layer.post_norm.weight.data_ptr(),
                layer.qkv.packed.data_ptr(),
                0 if layer.qkv.bias is None else layer.qkv.bias.data_ptr(),
                a.o_proj.packed_weight.data_ptr(),
                0 if a.o_proj.bias is None else a.o_proj.bias.data_ptr(),
                mlp.gate_up_packed.data_ptr(),
                mlp.down_proj.packed_weight.data_ptr(),
                0 if mlp.down_proj.bias is None else mlp.down_proj.bias.data_ptr(),
                0,
                0,
            ]
        )
    if len(scales) != 1:
        return None
    ptrs = np.array(rows, dtype=np.int64)
    if ptrs.shape[1] != lib.decode_stack_layer_ptrs():
        return None
    return DecodeStack(lib, loop, ptrs)
