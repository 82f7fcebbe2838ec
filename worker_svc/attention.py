"""Paged attention for stock Hugging Face models, through transformers' AttentionInterface.

The runner calls the model once per step on a packed batch (`input_ids` [1, T]) holding every
scheduled token of every request, decodes first (sorted by context length), then prefill chunks.
`build_metadata` turns the step's layout into tensors ONCE; `paged_attention_forward`, called by
each layer, then only
- writes the new tokens' K/V into their cache slots (slot = block * block_size + offset),
- gathers the cached K/V of all requests with one `index_select` over block ids per K and V,
- runs one SDPA per group of ~8 decode rows (a key-padding mask covers their different lengths)
  and one per prefill chunk (causal; offset-causal when the chunk follows cached tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "splitserve_paged"
METADATA_KWARG = "paged_metadata"


@dataclass(slots=True)
class AttentionGroup:
    """Query rows [q_start, q_end) of the packed batch and the K/V they attend to.

    decode group: q_end - q_start rows of one query token each, the K/V of row i being gathered
    blocks [gather_start + i * n_blocks, ... + n_blocks). prefill chunk: one request's q tokens
    (as one SDPA batch row) over n_blocks gathered blocks, or over its own fresh K/V when
    n_blocks == 0 (nothing cached before it: plain causal attention).
    """

    q_start: int
    q_end: int
    gather_start: int
    n_blocks: int
    is_decode: bool
    mask: torch.Tensor | None = None  # bool, True = attend; None: attend to all (or is_causal)


@dataclass(slots=True)
class AttentionMetadata:
    key_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, kv_heads, head_dim]
    value_caches: list[torch.Tensor]
    block_size: int
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each packed token
    gather_ids: torch.Tensor  # [G] int64: block ids to gather, all groups concatenated
    groups: list[AttentionGroup] = field(default_factory=list)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, T, head_dim]
    key: torch.Tensor,  # [1, kv_heads, T, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    meta: AttentionMetadata | None = kwargs.get(METADATA_KWARG)
    if meta is None:
        raise RuntimeError(
            f"{ATTN_IMPLEMENTATION} attention needs `{METADATA_KWARG}`: call the model through "
            "the ModelRunner"
        )
    k_cache = meta.key_caches[module.layer_idx]
    v_cache = meta.value_caches[module.layer_idx]
    _, kv_heads, _, head_dim = key.shape
    bs = meta.block_size
    k_new = key[0].transpose(0, 1)  # [T, kv_heads, head_dim]
    v_new = value[0].transpose(0, 1)
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k_new)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v_new)
    if meta.gather_ids.numel():
        k_all = k_cache.index_select(0, meta.gather_ids)  # [G, bs, kv_heads, head_dim]
        v_all = v_cache.index_select(0, meta.gather_ids)
    q = query[0].transpose(0, 1)  # [T, heads, head_dim]
    outs = []
    for g in meta.groups:
        if g.is_decode:
            n = g.q_end - g.q_start
            end = g.gather_start + n * g.n_blocks
            shape = (n, g.n_blocks * bs, kv_heads, head_dim)
            k = k_all[g.gather_start : end].view(shape).transpose(1, 2)  # [n, kvh, L, d]
            v = v_all[g.gather_start : end].view(shape).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[g.q_start : g.q_end].unsqueeze(2), k, v, attn_mask=g.mask, scale=scaling,
                enable_gqa=True,
            )  # fmt: skip
            outs.append(o.squeeze(2))  # [n, heads, head_dim]
            continue
        qp = query[:, :, g.q_start : g.q_end]  # [1, heads, q, d]
        if g.n_blocks == 0:
            k = key[:, :, g.q_start : g.q_end]
            v = value[:, :, g.q_start : g.q_end]
        else:
            end = g.gather_start + g.n_blocks
            shape = (1, g.n_blocks * bs, kv_heads, head_dim)
            k = k_all[g.gather_start : end].view(shape).transpose(1, 2)
            v = v_all[g.gather_start : end].view(shape).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            qp, k, v, attn_mask=g.mask, is_causal=g.n_blocks == 0, scale=scaling, enable_gqa=True
        )
        outs.append(o[0].transpose(0, 1))  # [q, heads, head_dim]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.unsqueeze(0), None


def register() -> str:
    """Register the paged attention function with transformers; returns its name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION


def build_metadata(
    *,
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_size: int,
    block_table: np.ndarray,  # [R, max_blocks] per packed request; unused entries any valid id
    num_computed: np.ndarray,  # per packed request: tokens already in the cache
    num_scheduled: np.ndarray,  # per packed request: tokens in this step (1 for decodes)
    num_decodes: int,  # the first num_decodes requests are decodes, sorted by context length
    decode_group_size: int,
    slot_mapping: torch.Tensor,
    device: torch.device,
) -> AttentionMetadata:
    """The per-step tensors every layer's attention call shares (built once per step)."""
    groups: list[AttentionGroup] = []
    gather: list[np.ndarray] = []
    gathered = 0
    q_start = 0
    ctx_len = num_computed + num_scheduled
    for start in range(0, num_decodes, decode_group_size):
        stop = min(start + decode_group_size, num_decodes)
        lens = ctx_len[start:stop]
        n_blocks = -(-int(lens.max()) // block_size)
        ids = block_table[start:stop, :n_blocks]  # blocks past a row's length are masked
        mask = None
        span = n_blocks * block_size
        if (lens != span).any():
            mask = torch.from_numpy(np.arange(span)[None, :] < lens[:, None])
            mask = mask.view(stop - start, 1, 1, span).to(device, non_blocking=True)
        groups.append(
            AttentionGroup(q_start, q_start + stop - start, gathered, n_blocks, True, mask)
        )
        gather.append(ids.reshape(-1))
        gathered += ids.size
        q_start += stop - start
    for r in range(num_decodes, len(num_scheduled)):
        q, c = int(num_scheduled[r]), int(num_computed[r])
        if c == 0:
            groups.append(AttentionGroup(q_start, q_start + q, gathered, 0, False))
        else:
            n_blocks = -(-(c + q) // block_size)
            span = n_blocks * block_size
            # offset-causal: query i (position c + i) sees keys 0..c + i
            mask = np.arange(span)[None, :] <= (c + np.arange(q))[:, None]
            mask_t = torch.from_numpy(mask).view(1, 1, q, span).to(device, non_blocking=True)
            groups.append(AttentionGroup(q_start, q_start + q, gathered, n_blocks, False, mask_t))
            gather.append(block_table[r, :n_blocks])
            gathered += n_blocks
        q_start += q
    gather_ids = np.concatenate(gather).astype(np.int64) if gather else np.zeros(0, np.int64)
    return AttentionMetadata(
        key_caches=key_caches,
        value_caches=value_caches,
        block_size=block_size,
        slot_mapping=slot_mapping,
        gather_ids=torch.from_numpy(gather_ids).to(device, non_blocking=True),
        groups=groups,
    )
