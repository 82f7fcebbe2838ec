"""The runner's own loop over a Llama decoder's layers, in place of Hugging Face's forward.

HF's forward reaches each layer's arithmetic through several Python layers (decorators, kwargs
plumbing, module calls, views, the attention-interface lookup), a fixed cost per layer that
is a noticeable part of a step at decode sizes, where the layers' arithmetic is small. This loop
calls the same modules and kernels on the same weights in the same order, so its logits are HF's
bits (tested against the HF forward in float32 and bfloat16), and it fuses two things the stock
graph does apart, where the fusion keeps the bits:
- a residual add and the next RMSNorm in one pass over the rows (fused_ops.add_rms_norm_);
- q, k and v in one AMX GEMM at decode sizes, over one packed weight (the three projections'
  packed weights become views into it): each output column is summed as it was alone.

Built only where it is known to be HF's computation: the model classes in SUPPORTED, the
runner's paged attention, native RMSNorms (fused ops on, CPU). Otherwise, or with `--compile`,
the runner keeps the HF forward. A step where every row decodes goes on to the native decode
stack (decode_stack.py: these layers in one C call) where that applies.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch
from torch import nn

from worker_svc import attention, decode_stack
from worker_svc.fast_linear import AMX_MAX_ROWS, AmxLinear
from worker_svc.fused_ops import FusedOps, NativeRMSNorm

log = logging.getLogger("splitserve.worker.decoder_loop")

SUPPORTED = frozenset({"LlamaForCausalLM"})


@dataclass(slots=True)
class _Layer:
    attn: nn.Module
    input_norm: NativeRMSNorm
    post_norm: NativeRMSNorm
    mlp: nn.Module
    head_dim: int
    qkv: FusedQKV | None


class FusedQKV:
    """q, k and v projections as one AMX GEMM over their packed weights laid end to end (whole
    16-column panels, so each projection's packed weight is a slice of the joint one)."""

    def __init__(self, q: AmxLinear, k: AmxLinear, v: AmxLinear) -> None:
        self.gemm = q.gemm
        self.sizes = (q.out_features, k.out_features, v.out_features)
        self.packed = torch.cat([q.packed_weight, k.packed_weight, v.packed_weight])
        self.bias = None if q.bias is None else torch.cat([q.bias, k.bias, v.bias])
        start = 0
        for proj, size in zip((q, k, v), self.sizes, strict=True):
            proj.packed_weight = nn.Parameter(
                self.packed[start // 16 : (start + size) // 16], requires_grad=False
            )
            start += size

    @staticmethod
    def applies(q, k, v) -> bool:
        projs = (q, k, v)
        return (
            all(isinstance(p, AmxLinear) and p.packed_weight is not None for p in projs)
            and len({p.in_features for p in projs}) == 1
            and len({p.gemm for p in projs}) == 1
            and len({p.bias is None for p in projs}) == 1
            and all(p.out_features % 32 == 0 for p in projs)
        )

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.gemm(h, self.packed, sum(self.sizes), self.bias)
        return out.split(self.sizes, dim=-1)


class DecoderLoop:
    def __init__(self, model: nn.Module, ops: FusedOps) -> None:
        self.model = model
        self.inner = model.model
        self.ops = ops
        cfg = model.config.get_text_config()
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        # the modeling module's rotary function, as the attention forward looks it up (the
        # runner's NativeRotary where installed)
        self._rotary_module = sys.modules[type(self.inner.layers[0].self_attn).__module__]
        self.layers = []
        for layer in self.inner.layers[: cfg.num_hidden_layers]:
            a = layer.self_attn
            projs = (a.q_proj, a.k_proj, a.v_proj)
            qkv = FusedQKV(*projs) if FusedQKV.applies(*projs) else None
            self.layers.append(
                _Layer(
                    attn=a,
                    input_norm=layer.input_layernorm,
                    post_norm=layer.post_attention_layernorm,
                    mlp=layer.mlp,
                    head_dim=int(a.head_dim),
                    qkv=qkv,
                )
            )
        self.fused_qkv = sum(layer.qkv is not None for layer in self.layers)
        self.stack = decode_stack.build(self)  # pure-decode steps in one native call

    def __call__(
        self,
        input_ids: torch.Tensor,  # [1, T]
        position_ids: torch.Tensor,  # [1, T]
        logits_index: torch.Tensor,  # [n] rows whose logits are wanted
        meta: attention.AttentionMetadata,
    ) -> torch.Tensor:
        """Logits [n, vocab] of the rows in logits_index (the caller holds inference mode)."""
        ops, kwargs = self.ops, {attention.METADATA_KWARG: meta}
        x = self.inner.embed_tokens(input_ids)[0]  # [T, hidden]: the residual stream, ours
        cos, sin = self.inner.rotary_emb(x, position_ids)
        if self.stack is not None and self.stack.applies(x, cos, meta):
            h = self.stack(x, cos, sin, meta)
            if h is not None:
                return self.model.lm_head(h[logits_index])
        rotary = self._rotary_module.apply_rotary_pos_emb
        tokens = x.shape[0]
        delta = None  # the previous layer's MLP output, added at the next norm
        for layer in self.layers:
            norm = layer.input_norm
            h = (
                ops.rms_norm(x, norm.weight, norm.variance_epsilon)
                if delta is None
                else ops.add_rms_norm_(x, delta, norm.weight, norm.variance_epsilon)
            )
            a = layer.attn
            if layer.qkv is not None and tokens <= AMX_MAX_ROWS:
                q, k, v = layer.qkv(h)
            else:
                q, k, v = a.q_proj(h), a.k_proj(h), a.v_proj(h)
            hd = layer.head_dim
            q = q.view(1, tokens, self.num_heads, hd).transpose(1, 2)
            k = k.view(1, tokens, self.num_kv_heads, hd).transpose(1, 2)
            v = v.view(1, tokens, self.num_kv_heads, hd).transpose(1, 2)
            q, k = rotary(q, k, cos, sin)
            o, _ = attention.paged_attention_forward(a, q, k, v, None, scaling=a.scaling, **kwargs)
            o = a.o_proj(o.reshape(tokens, -1))
            norm = layer.post_norm
            delta = layer.mlp(ops.add_rms_norm_(x, o, norm.weight, norm.variance_epsilon))
        norm = self.inner.norm
        h = ops.add_rms_norm_(x, delta, norm.weight, norm.variance_epsilon)
        return self.model.lm_head(h[logits_index])


def build(model: nn.Module, ops: FusedOps | None) -> DecoderLoop | None:
    """The loop for `model` where it computes what HF's forward computes, else None."""
    if ops is None or type(model).__name__ not in SUPPORTED:
        return None
    cfg = model.config.get_text_config()
    if getattr(cfg, "_attn_implementation", None) != attention.ATTN_IMPLEMENTATION:
        return None
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers or not isinstance(inner.norm, NativeRMSNorm):
        return None
    dtype = inner.norm.weight.dtype
    for layer in layers:
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not all(isinstance(n, NativeRMSNorm) and n.weight.dtype == dtype for n in norms):
            return None
        if type(layer).__name__ != "LlamaDecoderLayer":
            return None
    loop = DecoderLoop(model, ops)
    log.info(
        "decoder loop: %d layers, q/k/v fused in %d, native decode stack %s",
        len(loop.layers),
        loop.fused_qkv,
        "on" if loop.stack is not None else "off",
    )
    return loop
