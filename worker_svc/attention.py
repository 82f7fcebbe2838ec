"""Paged attention: the model implementation's attention op, over the paged KV cache.

The runner calls the model once per step on a packed batch (T tokens) holding every scheduled
token of every request, decodes first (sorted by context length), then prefill chunks.
`build_metadata` turns the step's layout into tensors ONCE; `paged_attention`, called by each
layer, then only
- writes the new tokens' K/V into their cache slots (slot = block * block_size + offset),
- gathers each group's cached K/V with one `index_select` over block ids per K and V (per
  group, so that SDPA reads them while they are still in the CPU cache),
- runs one SDPA per group of ~8 decode rows (a key-padding mask covers their different lengths)
  and one per prefill chunk (causal; offset-causal when the chunk follows cached tokens).
On the CPU, when the native kernels (worker_svc.native_attention) are available, all decode rows
go through one call instead, and all prefill chunks through another (causal by position, the
chunk's own K/V read back from the cache): both read K/V in place through the block table, no
gather, no mask tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from worker_svc.native_attention import PagedDecodeKernel


@dataclass(slots=True)
class AttentionGroup:
    """Query tokens [q_start, q_end) of the packed batch: `rows` requests of equal query length.

    A decode group is several rows of one token each; a prefill chunk is one row of q tokens.
    Row i attends to blocks block_ids[i * n_blocks : (i + 1) * n_blocks], or, when n_blocks == 0
    (a chunk with nothing cached before it), causally to its own fresh K/V.
    """

    q_start: int
    q_end: int
    rows: int
    n_blocks: int
    block_ids: torch.Tensor | None = None  # [rows * n_blocks] int64, the blocks to gather
    mask: torch.Tensor | None = None  # additive (0 / -inf); None: all keys (or causal)


@dataclass(slots=True)
class PaddedDecode:
    """A decode step of fixed shape (what a CUDA graph replays): every row one query token over
    a block table of fixed width, the keys past each row's length masked out."""

    block_table: torch.Tensor  # [rows, width] int64; past a row's blocks: the scratch block
    key_mask: torch.Tensor  # [rows, 1, 1, width * block_size] bool: key j < the row's length


@dataclass(slots=True)
class AttentionMetadata:
    key_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, kv_heads, head_dim]
    value_caches: list[torch.Tensor]
    block_size: int
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each packed token
    groups: list[AttentionGroup] = field(default_factory=list)
    # native decode: the first num_native_decodes packed tokens, one per request
    decode_kernel: PagedDecodeKernel | None = None
    num_native_decodes: int = 0
    decode_block_table: torch.Tensor | None = None  # [rows, max_blocks] int64
    decode_seq_lens: torch.Tensor | None = None  # [rows] int64
    decode_max_len: int = 0
    # native prefill: every chunk after the decodes in one kernel call
    prefill_block_table: torch.Tensor | None = None  # [chunks, max_blocks] int64
    prefill_q_start: torch.Tensor | None = None  # [chunks] int64, from the first chunk's token
    prefill_q_len: torch.Tensor | None = None
    prefill_cached: torch.Tensor | None = None
    padded_decode: PaddedDecode | None = None


def paged_attention(
    query: torch.Tensor,  # [T, heads, head_dim]
    key: torch.Tensor,  # [T, kv_heads, head_dim]; head_dim contiguous
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]: this layer's
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write the step's K/V into the cache, then attend: [T, heads * head_dim]."""
    _, kv_heads, head_dim = key.shape
    bs = meta.block_size
    kernel = meta.decode_kernel
    if kernel is not None:
        kernel.write_kv(
            key.transpose(0, 1), value.transpose(0, 1), k_cache, v_cache, meta.slot_mapping
        )
    else:
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key)
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value)
    if meta.padded_decode is not None:
        return _padded_decode(query, k_cache, v_cache, meta.padded_decode, scale)
    outs = []
    nd = meta.num_native_decodes
    if nd:
        q_dec = query[:nd].contiguous()  # float32 or bfloat16: the kernel converts what it must
        o = kernel(
            q_dec,
            k_cache,
            v_cache,
            meta.decode_block_table,
            meta.decode_seq_lens,
            meta.decode_max_len,
            scale,
        )
        outs.append(o.to(query.dtype))
    if meta.prefill_q_len is not None:
        o = kernel.prefill(
            query[nd:].contiguous(),
            k_cache,
            v_cache,
            meta.prefill_block_table,
            meta.prefill_q_start,
            meta.prefill_q_len,
            meta.prefill_cached,
            scale,
        )
        outs.append(o.to(query.dtype))
    for g in meta.groups:
        qg = query[g.q_start : g.q_end].unflatten(0, (g.rows, -1)).transpose(1, 2)  # [r,h,q,d]
        if g.n_blocks:
            shape = (g.rows, g.n_blocks * bs, kv_heads, head_dim)
            k = k_cache.index_select(0, g.block_ids).view(shape).transpose(1, 2)  # [r,kvh,L,d]
            v = v_cache.index_select(0, g.block_ids).view(shape).transpose(1, 2)
        else:
            k = key[g.q_start : g.q_end].transpose(0, 1).unsqueeze(0)
            v = value[g.q_start : g.q_end].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qg, k, v, attn_mask=g.mask, is_causal=not g.n_blocks, scale=scale, enable_gqa=True
        )
        outs.append(o.transpose(1, 2).flatten(0, 1))  # [r * q, heads, head_dim]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(out.shape[0], -1)


def _padded_decode(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pd: PaddedDecode, scale
) -> torch.Tensor:
    rows, heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    shape = (rows, -1, kv_heads, head_dim)
    k = k_cache[pd.block_table].view(shape).transpose(1, 2)  # [rows, kv_heads, L, head_dim]
    v = v_cache[pd.block_table].view(shape).transpose(1, 2)
    o = F.scaled_dot_product_attention(
        query.unsqueeze(2), k, v, attn_mask=pd.key_mask, scale=scale, enable_gqa=True
    )
    return o.reshape(rows, heads * head_dim)


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
    dtype: torch.dtype,
    device: torch.device,
    decode_kernel: PagedDecodeKernel | None = None,
    native_prefill: bool = False,
) -> AttentionMetadata:
    """The per-step tensors every layer's attention call shares (built once per step)."""
    groups: list[AttentionGroup] = []
    q_start = 0
    ctx_len = num_computed + num_scheduled
    meta = AttentionMetadata(
        key_caches=key_caches,
        value_caches=value_caches,
        block_size=block_size,
        slot_mapping=slot_mapping,
        groups=groups,
        decode_kernel=decode_kernel,
    )
    if decode_kernel is not None and num_decodes:  # every decode row in one kernel call
        lens = ctx_len[:num_decodes]
        n_blocks = -(-int(lens.max()) // block_size)
        meta.num_native_decodes = q_start = num_decodes
        meta.decode_block_table = _ids(block_table[:num_decodes, :n_blocks], device).view(
            num_decodes, n_blocks
        )
        meta.decode_seq_lens = torch.from_numpy(np.ascontiguousarray(lens, dtype=np.int64))
        meta.decode_max_len = int(lens.max())
    for start in range(meta.num_native_decodes, num_decodes, decode_group_size):
        stop = min(start + decode_group_size, num_decodes)
        rows, lens = stop - start, ctx_len[start:stop]
        n_blocks = -(-int(lens.max()) // block_size)
        ids = block_table[start:stop, :n_blocks]  # blocks past a row's length are masked
        span = n_blocks * block_size
        mask = None
        if (lens != span).any():
            allowed = np.arange(span)[None, :] < lens[:, None]
            mask = _additive(allowed, (rows, 1, 1, span), dtype, device)
        block_ids = _ids(ids, device)
        groups.append(AttentionGroup(q_start, q_start + rows, rows, n_blocks, block_ids, mask))
        q_start += rows
    if decode_kernel is not None and native_prefill and num_decodes < len(num_scheduled):
        n = num_scheduled[num_decodes:].astype(np.int64)
        c = num_computed[num_decodes:].astype(np.int64)
        n_blocks = -(-int((c + n).max()) // block_size)
        meta.prefill_block_table = _ids(block_table[num_decodes:, :n_blocks], device).view(
            len(n), n_blocks
        )
        meta.prefill_q_start = torch.from_numpy(np.cumsum(n) - n)
        meta.prefill_q_len = torch.from_numpy(np.ascontiguousarray(n))
        meta.prefill_cached = torch.from_numpy(np.ascontiguousarray(c))
        return meta
    for r in range(num_decodes, len(num_scheduled)):
        q, c = int(num_scheduled[r]), int(num_computed[r])
        if c == 0:  # nothing cached before this chunk: causal over its own K/V
            groups.append(AttentionGroup(q_start, q_start + q, 1, 0))
        else:
            n_blocks = -(-(c + q) // block_size)
            span = n_blocks * block_size
            # offset-causal: query i (position c + i) sees keys 0..c + i
            allowed = np.arange(span)[None, :] <= (c + np.arange(q))[:, None]
            mask = _additive(allowed, (1, 1, q, span), dtype, device)
            block_ids = _ids(block_table[r, :n_blocks], device)
            groups.append(AttentionGroup(q_start, q_start + q, 1, n_blocks, block_ids, mask))
        q_start += q
    return meta


def _ids(ids: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)).to(device)


def _additive(allowed: np.ndarray, shape: tuple[int, ...], dtype, device) -> torch.Tensor:
    """A bool mask as the additive float mask SDPA would otherwise rebuild in every layer."""
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(torch.from_numpy(~allowed), float("-inf"))
    return mask.view(shape).to(device, non_blocking=True)
