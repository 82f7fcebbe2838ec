"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3), written over the op table.

    model = CausalLM.from_hf(hf_model, ops)    # takes the weights; transformers only loaded them
    logits = model(input_ids, positions, logits_index, meta, caches)

One step is one packed sequence of T tokens (worker_svc.model_runner lays it out): every
scheduled token of every request, with its position and its cache slot in `meta`. A layer is

    h = norm(x)                       (the previous layer's MLP output added to x first)
    q, k, v = qkv(h)                  one GEMM
    q, k = norm_per_head(q, k)        Qwen3
    q, k = rotary(q), rotary(k)
    o = o_proj(paged_attention(q, k, v))
    h = norm(x += o)
    delta = down(silu(gate(h)) * up(h))

and the logits are lm_head(norm(x += delta)) at the rows that sample. Pure-decode steps may run
as one call where the backend offers one (`decode_step`: the native decode stack on the CPU, a
captured CUDA graph on a GPU), built from these same layers.

A step whose rows run LoRA adapters (`lora`, worker_svc/lora) runs the layer loop, each
projection's output plus its rows' adapter deltas: q, k, v; o_proj; gate and up before the
SiLU; down_proj. A step without any is the path above, untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from worker_svc.attention import AttentionMetadata, paged_attention
from worker_svc.model.spec import ModelSpec, spec_of
from worker_svc.ops.reference import Linear, ReferenceOps

if TYPE_CHECKING:
    from worker_svc.lora import StepLora


@dataclass(slots=True)
class DecoderLayer:
    index: int
    input_norm: torch.Tensor  # RMSNorm weights
    post_norm: torch.Tensor
    qkv: Linear  # h -> (q, k, v)
    o_proj: Linear
    gated: Linear  # h -> silu(gate(h)) * up(h)
    down_proj: Linear
    q_norm: torch.Tensor | None = None  # Qwen3: per-head RMSNorm of q and k before rotary
    k_norm: torch.Tensor | None = None


class DecodeStep(Protocol):
    """A whole pure-decode step as one call (the backend's): None where it does not apply."""

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None: ...


class CausalLM:
    def __init__(
        self,
        spec: ModelSpec,
        ops: ReferenceOps,
        embed_tokens: torch.Tensor,
        layers: list[DecoderLayer],
        final_norm: torch.Tensor,
        lm_head: Linear,
    ) -> None:
        self.spec, self.ops = spec, ops
        self.embed_tokens, self.layers, self.final_norm, self.lm_head = (
            embed_tokens,
            layers,
            final_norm,
            lm_head,
        )
        self.inv_freq = spec.inv_freq.to(embed_tokens.device)
        self.decode_step: DecodeStep | None = None

    @classmethod
    def from_hf(cls, hf_model: torch.nn.Module, ops: ReferenceOps) -> CausalLM:
        """The weights of a loaded transformers model, prepared for `ops` (packed, quantized:
        each backend keeps its own copies); spec.UnsupportedModel where it is not one of ours."""
        spec = spec_of(hf_model)
        inner = hf_model.model
        layers = []
        for index, layer in enumerate(inner.layers[: spec.num_layers]):
            attn, mlp = layer.self_attn, layer.mlp
            projs = (attn.q_proj, attn.k_proj, attn.v_proj)
            layers.append(
                DecoderLayer(
                    index=index,
                    input_norm=_w(layer.input_layernorm),
                    post_norm=_w(layer.post_attention_layernorm),
                    qkv=ops.qkv([_w(p) for p in projs], [_b(p) for p in projs]),
                    o_proj=ops.linear(_w(attn.o_proj), _b(attn.o_proj)),
                    gated=ops.gated_product(_w(mlp.gate_proj), _w(mlp.up_proj)),
                    down_proj=ops.linear(_w(mlp.down_proj), _b(mlp.down_proj)),
                    q_norm=_w(attn.q_norm) if spec.qk_norm else None,
                    k_norm=_w(attn.k_norm) if spec.qk_norm else None,
                )
            )
        head = hf_model.get_output_embeddings()
        return cls(
            spec,
            ops,
            embed_tokens=_w(inner.embed_tokens),
            layers=layers,
            final_norm=_w(inner.norm),
            lm_head=ops.linear(_w(head), _b(head)),
        )

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        logits_index: torch.Tensor,  # [S] the rows whose logits are wanted
        meta: AttentionMetadata,
        lora: StepLora | None = None,
    ) -> torch.Tensor:
        """Logits [S, vocab] (the caller holds inference mode)."""
        ops, spec = self.ops, self.spec
        x = F.embedding(input_ids, self.embed_tokens)  # [T, hidden]: the residual stream
        cos, sin = ops.rotary_tables(positions, self.inv_freq, spec.rope_scaling)
        if self.decode_step is not None and lora is None:
            h = self.decode_step(x, cos, sin, meta)
            if h is not None:
                return self.lm_head(h[logits_index])
        tokens, eps = x.shape[0], spec.rms_norm_eps
        delta = None  # the previous layer's MLP output, added to x at the next norm
        for layer in self.layers:
            h = (
                ops.rms_norm(x, layer.input_norm, eps)
                if delta is None
                else ops.add_rms_norm_(x, delta, layer.input_norm, eps)
            )
            q, k, v = layer.qkv(h)
            if lora is not None:
                ops.add_lora_(h, (q, k, v), lora.layers[layer.index]["qkv"], lora)
            q = q.view(tokens, spec.num_heads, spec.head_dim)
            k = k.view(tokens, spec.num_kv_heads, spec.head_dim)
            v = v.view(tokens, spec.num_kv_heads, spec.head_dim)
            if layer.q_norm is not None:
                q = ops.rms_norm(q, layer.q_norm, eps)
                k = ops.rms_norm(k, layer.k_norm, eps)
            q, k = ops.rotary(q, cos, sin), ops.rotary(k, cos, sin)
            o = paged_attention(
                q,
                k,
                v,
                meta.key_caches[layer.index],
                meta.value_caches[layer.index],
                meta,
                spec.scale,
            )
            if lora is None:
                h = ops.add_rms_norm_(x, layer.o_proj(o), layer.post_norm, eps)
                delta = layer.down_proj(layer.gated(h))
            else:
                h = ops.add_rms_norm_(x, self._lora_o_proj(layer, o, lora), layer.post_norm, eps)
                delta = self._lora_mlp(layer, h, lora)
        h = ops.add_rms_norm_(x, delta, self.final_norm, eps)
        return self.lm_head(h[logits_index])

    def _lora_o_proj(self, layer: DecoderLayer, o: torch.Tensor, lora: StepLora) -> torch.Tensor:
        out = layer.o_proj(o)
        self.ops.add_lora_(o, (out,), lora.layers[layer.index]["o"], lora)
        return out

    def _lora_mlp(self, layer: DecoderLayer, h: torch.Tensor, lora: StepLora) -> torch.Tensor:
        sites = lora.layers[layer.index]
        gate, up = layer.gated.pre_activations(h)
        self.ops.add_lora_(h, (gate, up), sites["gate_up"], lora)
        product = layer.gated.activate(gate, up)
        out = layer.down_proj(product)
        self.ops.add_lora_(product, (out,), sites["down"], lora)
        return out


def _w(module: torch.nn.Module) -> torch.Tensor:
    return module.weight.detach()


def _b(module: torch.nn.Module) -> torch.Tensor | None:
    bias = getattr(module, "bias", None)
    return None if bias is None else bias.detach()
