"""A decoder's layers for a pure-decode step in one native call (csrc/decode_stack.c).

The runner's layer loop (decoder_loop.py) runs Python between the kernels of every layer
(module calls, views, allocations, ctypes calls); the kernels it calls release the GIL, but the
second OpenMP thread can only wait through that Python, and at decode sizes that wait is a
noticeable share of a step. Here the same kernels run in the same order with the same arguments
from C, so the result is the loop's bits (tested against it), for the steps where every row
decodes and every layer runs on the native kernels: float32 on the packed GEMM (over float32
weights, or int8 ones under --quantization int8), bfloat16 on the AMX GEMMs (q/k/v and gate/up
fused as in the loop), both with the native norms, rotary and decode attention. Any other
step, or a step under the torch profiler (so its ops show), keeps the Python loop.
"""

from __future__ import annotations

import ctypes
import logging
from types import ModuleType
from typing import Protocol

import numpy as np
import torch
from torch.autograd import profiler

from worker_svc import native_attention
from worker_svc.fast_linear import AMX_MAX_ROWS, AmxLinear, Int8PackedLinear, NativePackedLinear
from worker_svc.fused_ops import NativeGatedMLP, NativeRotary

log = logging.getLogger("splitserve.worker.decode_stack")

_I64, _P, _F = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
# a layer's pointers, in csrc/decode_stack.c's order
PTRS = (
    "input_norm",
    "post_norm",
    "q",
    "q_bias",
    "k",
    "k_bias",
    "v",
    "v_bias",
    "o",
    "o_bias",
    "gate",
    "gate_bias",
    "up",
    "up_bias",
    "down",
    "down_bias",
    "k_cache",
    "v_cache",
    "q_scale",  # int8 weights' per-column scales (0: float32 weights)
    "k_scale",
    "v_scale",
    "o_scale",
    "gate_scale",
    "up_scale",
    "down_scale",
)
_K_CACHE, _V_CACHE = PTRS.index("k_cache"), PTRS.index("v_cache")
_AVAILABLE_BIT = {torch.float32: 1, torch.bfloat16: 2}


class LoopView(Protocol):
    """What the stack reads from the decoder_loop.DecoderLoop that builds it (that module
    imports this one, so this one names the loop by what it uses)."""

    inner: torch.nn.Module  # the model's decoder: its final norm
    layers: list  # decoder_loop._Layer: attn, input_norm, post_norm, mlp, head_dim
    num_heads: int
    num_kv_heads: int
    _rotary_module: ModuleType  # where the attention looks up its rotary function


class DecodeStack:
    def __init__(self, lib: ctypes.CDLL, loop: LoopView, dtype: torch.dtype, layer_ptrs):
        self._fn = lib.decode_stack
        self._fn.argtypes = [
            ctypes.c_int,
            _P,
            _P,
            _I64,
            _P,
            *[_I64] * 6,
            _P,
            _P,
            _I64,
            _P,
            _P,
            _I64,
            _P,
            _I64,
            _I64,
            _F,
            _P,
            _F,
            _P,
            _P,
            _I64,
        ]
        self._fn.restype = ctypes.c_int
        self._scratch_bytes = lib.decode_stack_scratch_bytes
        self._scratch_bytes.argtypes = [_I64] * 7
        self._scratch_bytes.restype = _I64
        self.loop, self.dtype = loop, dtype
        self.bf16 = int(dtype == torch.bfloat16)
        first = loop.layers[0]
        self.hidden = first.input_norm.weight.shape[0]
        self.head_dim = first.head_dim
        self.intermediate = first.mlp.gate_proj.out_features
        self.scale = float(first.attn.scaling)
        self.layer_idx = [layer.attn.layer_idx for layer in loop.layers]
        self.layer_ptrs = layer_ptrs  # [layers, len(PTRS)]: weights; the caches set per call
        self.eps = np.array(
            [(la.input_norm.variance_epsilon, la.post_norm.variance_epsilon) for la in loop.layers],
            dtype=np.float32,
        ).reshape(-1)
        self.final_norm = loop.inner.norm
        # bfloat16 past AMX_MAX_ROWS rows the loop's linears go to oneDNN: not these kernels
        self.max_rows = AMX_MAX_ROWS if self.bf16 else 1 << 30
        self.enabled = True

    def applies(self, x: torch.Tensor, cos: torch.Tensor, meta) -> bool:
        tokens = x.shape[0]
        rotary = self.loop._rotary_module.apply_rotary_pos_emb  # noqa: SLF001
        return (
            self.enabled
            and 0 < tokens <= self.max_rows
            and meta.num_native_decodes == tokens
            and meta.prefill_q_len is None
            and not meta.groups
            and x.dtype == cos.dtype == meta.key_caches[0].dtype == self.dtype
            and x.is_contiguous()
            and cos.shape == (1, tokens, self.head_dim)
            and cos.stride(-1) == 1
            and isinstance(rotary, NativeRotary)
            and rotary.enabled
            and not profiler._is_profiler_enabled  # noqa: SLF001
        )

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta):
        """The final norm's output [T, hidden] (x, the residual stream, changes in place), or
        None where the attention has no body for these inputs on this CPU (x unchanged; the
        caller runs its loop, and this stack stays off)."""
        loop, tokens = self.loop, x.shape[0]
        ptrs = self.layer_ptrs
        ptrs[:, _K_CACHE] = [meta.key_caches[i].data_ptr() for i in self.layer_idx]
        ptrs[:, _V_CACHE] = [meta.value_caches[i].data_ptr() for i in self.layer_idx]
        dims = (
            tokens,
            self.hidden,
            loop.num_heads,
            loop.num_kv_heads,
            self.head_dim,
            self.intermediate,
        )
        scratch = torch.empty(self._scratch_bytes(x.element_size(), *dims), dtype=torch.uint8)
        out = torch.empty(tokens, self.hidden, dtype=x.dtype)
        table = meta.decode_block_table
        rc = self._fn(
            self.bf16,
            ptrs.ctypes.data,
            self.eps.ctypes.data,
            len(self.layer_idx),
            x.data_ptr(),
            *dims,
            cos.data_ptr(),
            sin.data_ptr(),
            cos.stride(1),
            meta.slot_mapping.data_ptr(),
            table.data_ptr(),
            table.stride(0),
            meta.decode_seq_lens.data_ptr(),
            meta.decode_max_len,
            meta.block_size,
            self.scale,
            self.final_norm.weight.data_ptr(),
            self.final_norm.variance_epsilon,
            out.data_ptr(),
            scratch.data_ptr(),
            torch.get_num_threads(),
        )
        if rc == -2:
            log.info("no %s decode attention body on this CPU: the Python layer loop", x.dtype)
            self.enabled = False
            return None
        if rc != 0:
            raise RuntimeError("the native decode stack failed (a kernel refused or no memory)")
        return out


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _layer_ptrs(layer, dtype: torch.dtype) -> dict[str, int] | None:
    """A layer's pointers where it runs on the stack's kernels for `dtype`, else None."""
    a, mlp = layer.attn, layer.mlp
    if (
        not isinstance(mlp, NativeGatedMLP)
        or layer.head_dim % 32  # the native rotary's condition
        or getattr(a, "layer_idx", None) is None
        or layer.input_norm.weight.dtype != dtype
        or layer.post_norm.weight.dtype != dtype
    ):
        return None
    ptrs = {"input_norm": _ptr(layer.input_norm.weight), "post_norm": _ptr(layer.post_norm.weight)}
    if dtype == torch.bfloat16:
        packed = (a.o_proj, mlp.down_proj)
        if (
            layer.qkv is None
            or mlp._amx is None  # noqa: SLF001
            or not all(isinstance(p, AmxLinear) and p.packed_weight is not None for p in packed)
        ):
            return None
        ptrs.update(
            q=_ptr(layer.qkv.packed), q_bias=_ptr(layer.qkv.bias), gate=_ptr(mlp.gate_up_packed)
        )
        linears = {"o": a.o_proj, "down": mlp.down_proj}
    else:
        linears = {
            "q": a.q_proj,
            "k": a.k_proj,
            "v": a.v_proj,
            "o": a.o_proj,
            "gate": mlp.gate_proj,
            "up": mlp.up_proj,
            "down": mlp.down_proj,
        }
        if layer.qkv is not None or not all(
            isinstance(p, (NativePackedLinear, Int8PackedLinear)) for p in linears.values()
        ):
            return None
    for name, linear in linears.items():
        ptrs[name] = _ptr(linear.packed_weight)
        ptrs[f"{name}_bias"] = _ptr(linear.bias)
        ptrs[f"{name}_scale"] = _ptr(getattr(linear, "scale", None))
    return ptrs


def build(loop: LoopView) -> DecodeStack | None:
    """The stack for `loop` where every layer runs on the kernels it calls, else None."""
    lib = native_attention.library_with("decode_stack_available")
    dtype = loop.inner.norm.weight.dtype
    if lib is None or not loop.layers or dtype not in _AVAILABLE_BIT:
        return None
    if not lib.decode_stack_available() & _AVAILABLE_BIT[dtype]:
        return None
    if lib.decode_stack_layer_ptrs() != len(PTRS):
        return None
    rows = []
    for layer in loop.layers:
        ptrs = _layer_ptrs(layer, dtype)
        if ptrs is None:
            return None
        rows.append([ptrs.get(name, 0) for name in PTRS])
    if len({float(layer.attn.scaling) for layer in loop.layers}) != 1:
        return None
    return DecodeStack(lib, loop, dtype, np.array(rows, dtype=np.int64))
