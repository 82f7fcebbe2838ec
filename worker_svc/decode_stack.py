"""A pure-decode step's layers in one native call (csrc/decode_stack.c): the native backend's
`decode_step` for the model implementation (worker_svc/model/llama.py).

The model's layer loop runs Python between the kernels of every layer (views, allocations,
ctypes calls); the kernels release the GIL, but the second OpenMP thread can only wait through
that Python. Here the same kernels run in the same order with the same arguments from C, so the
result is the loop's bits (tested against it), for the steps where every row decodes and every
layer runs on the native kernels: float32 on the packed GEMM (over float32 weights, or int8 ones
under --quantization int8), bfloat16 on the AMX GEMMs (q/k/v and gate/up fused as in the loop),
both with the native norms, rotary and decode attention. Any other step, or a step under the
torch profiler (so its ops show), runs the loop.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import torch
from torch.autograd import profiler

from worker_svc import native_attention
from worker_svc.model.llama import CausalLM, DecoderLayer
from worker_svc.ops.native import NativeGatedProduct, SeparateLinears
from worker_svc.ops.native_linear import AMX_MAX_ROWS, AmxLinear, NativePackedLinear
from worker_svc.ops.reference import SplitLinear

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


class DecodeStack:
    def __init__(self, lib: ctypes.CDLL, model: CausalLM, layer_ptrs: np.ndarray):
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
        spec = model.spec
        self.spec, self.dtype = spec, model.embed_tokens.dtype
        self.bf16 = int(self.dtype == torch.bfloat16)
        self.layer_ptrs = layer_ptrs  # [layers, len(PTRS)]: weights; the caches set per call
        self.eps = np.full(2 * spec.num_layers, spec.rms_norm_eps, dtype=np.float32)
        self.final_norm = model.final_norm
        # bfloat16 past AMX_MAX_ROWS rows the loop's linears go to oneDNN: not these kernels
        self.max_rows = AMX_MAX_ROWS if self.bf16 else 1 << 30
        self.enabled = True

    def applies(self, x: torch.Tensor, cos: torch.Tensor, meta) -> bool:
        tokens = x.shape[0]
        return (
            self.enabled
            and 0 < tokens <= self.max_rows
            and meta.num_native_decodes == tokens
            and meta.prefill_q_len is None
            and not meta.groups
            and x.dtype == cos.dtype == meta.key_caches[0].dtype == self.dtype
            and x.is_contiguous()
            and cos.shape == (tokens, self.spec.head_dim)
            and cos.stride(-1) == 1
            and not profiler._is_profiler_enabled  # noqa: SLF001
        )

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta):
        """The final norm's output [T, hidden] (x, the residual stream, changes in place), or
        None where the step is not one for the stack, or the attention has no body for these
        inputs on this CPU (x unchanged; the caller runs its loop, and this stack stays off)."""
        if not self.applies(x, cos, meta):
            return None
        spec, tokens = self.spec, x.shape[0]
        ptrs = self.layer_ptrs
        ptrs[:, _K_CACHE] = [c.data_ptr() for c in meta.key_caches[: spec.num_layers]]
        ptrs[:, _V_CACHE] = [c.data_ptr() for c in meta.value_caches[: spec.num_layers]]
        dims = (
            tokens,
            spec.hidden_size,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            spec.intermediate_size,
        )
        scratch = torch.empty(self._scratch_bytes(x.element_size(), *dims), dtype=torch.uint8)
        out = torch.empty(tokens, spec.hidden_size, dtype=x.dtype)
        table = meta.decode_block_table
        rc = self._fn(
            self.bf16,
            ptrs.ctypes.data,
            self.eps.ctypes.data,
            spec.num_layers,
            x.data_ptr(),
            *dims,
            cos.data_ptr(),
            sin.data_ptr(),
            cos.stride(0),
            meta.slot_mapping.data_ptr(),
            table.data_ptr(),
            table.stride(0),
            meta.decode_seq_lens.data_ptr(),
            meta.decode_max_len,
            meta.block_size,
            spec.scale,
            self.final_norm.data_ptr(),
            spec.rms_norm_eps,
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


def _layer_ptrs(layer: DecoderLayer, model: CausalLM) -> dict[str, int] | None:
    """A layer's pointers where it runs on the stack's kernels, else None."""
    spec, dtype = model.spec, model.embed_tokens.dtype
    qkv, gated = layer.qkv, layer.gated
    if (
        layer.q_norm is not None
        or spec.head_dim % 32  # the native rotary's condition
        or not isinstance(qkv, SplitLinear | SeparateLinears)
        or not isinstance(gated, NativeGatedProduct)
        or gated._ops is None  # noqa: SLF001
        or layer.input_norm.dtype != dtype
    ):
        return None
    ptrs = {"input_norm": _ptr(layer.input_norm), "post_norm": _ptr(layer.post_norm)}
    joined = qkv.linear if isinstance(qkv, SplitLinear) else None
    if dtype == torch.bfloat16:
        if not (
            isinstance(joined, AmxLinear)
            and gated.amx is not None
            and all(isinstance(p, AmxLinear) for p in (layer.o_proj, layer.down_proj))
        ):
            return None
        ptrs.update(q=_ptr(joined.packed_weight), q_bias=_ptr(joined.bias))
        ptrs["gate"] = _ptr(gated.gate_up_packed)
        linears = {"o": layer.o_proj, "down": layer.down_proj}
    else:
        linears = {"o": layer.o_proj, "gate": gated.gate, "up": gated.up, "down": layer.down_proj}
        if isinstance(qkv, SeparateLinears):  # q, k and v packed apart
            linears.update(zip("qkv", qkv.linears, strict=True))
        if not all(isinstance(p, NativePackedLinear) for p in linears.values()):
            return None
    if joined is not None and dtype != torch.bfloat16:
        if not isinstance(joined, NativePackedLinear):
            return None
        width = joined.gemm.panel_width
        if any(size % width for size in qkv.sizes):
            return None
        start = 0  # q, k and v as whole panels of the joined packing
        for name, size in zip("qkv", qkv.sizes, strict=True):
            ptrs[name] = _ptr(joined.packed_weight[start // width : (start + size) // width])
            for part, tensor in (("bias", joined.bias), ("scale", joined.scale)):
                ptrs[f"{name}_{part}"] = 0 if tensor is None else _ptr(tensor[start : start + size])
            start += size
    for name, linear in linears.items():
        ptrs[name] = _ptr(linear.packed_weight)
        ptrs[f"{name}_bias"] = _ptr(linear.bias)
        ptrs[f"{name}_scale"] = _ptr(getattr(linear, "scale", None))
    return ptrs


def build(model: CausalLM) -> DecodeStack | None:
    """The stack for `model` where every layer runs on the kernels it calls, else None."""
    lib = native_attention.library_with("decode_stack_available")
    dtype = model.embed_tokens.dtype
    if lib is None or not model.layers or dtype not in _AVAILABLE_BIT:
        return None
    if not lib.decode_stack_available() & _AVAILABLE_BIT[dtype]:
        return None
    if lib.decode_stack_layer_ptrs() != len(PTRS):
        return None
    rows = []
    for layer in model.layers:
        ptrs = _layer_ptrs(layer, model)
        if ptrs is None:
            return None
        rows.append([ptrs.get(name, 0) for name in PTRS])
    return DecodeStack(lib, model, np.array(rows, dtype=np.int64))
