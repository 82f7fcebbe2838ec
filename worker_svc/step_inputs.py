"""One step's inputs, laid out for the model (the ModelRunner's part between applying the diff
and running the forward).

Every scheduled token of every request in one packed sequence: decodes first, sorted by context
length (attention groups them), then prefill chunks; each token's position and cache slot; the
rows whose logits are wanted (the last token of each request that samples, every position of a
request with drafts); the attention metadata built once for all layers; or, where a CUDA graph
takes the step (pure decode, every row sampling, no LoRA adapter), the plain arrays its replay
copies in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from common.messages import SchedulerOutput
from worker_svc import attention
from worker_svc.config import ModelRunnerConfig
from worker_svc.cuda_graphs import DecodeGraphs
from worker_svc.input_batch import InputBatch
from worker_svc.kv_cache import KVCache
from worker_svc.ops.reference import ReferenceOps

# A verification laid out as decode rows reads its request's cached K/V once per row: past this
# many row-tokens ((1 + drafts) x context) one chunk, reading them once, is the cheaper layout
# (docs/speculative.md, "Verification as decode rows").
MAX_VERIFY_ROW_READS = 12288


@dataclass(slots=True)
class StepInputs:
    req_ids: list[str]  # packed order
    rows: np.ndarray  # batch rows, packed order
    num_scheduled: np.ndarray
    sample_mask: np.ndarray  # per packed request: does it sample this step
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    logits_index: torch.Tensor  # [S] packed index of each sampling request's last token
    meta: attention.AttentionMetadata | None  # None: the step replays a decode graph
    graph_step: tuple[np.ndarray, ...] | None = None  # DecodeGraphs.run's arguments
    # speculative decoding: per packed request its drafts ([] none); logits_index then covers
    # every position of a request with drafts (1 + k rows) and one of any other that samples
    drafts: list[list[int]] | None = None
    # per packed request its LoRA adapter ("" none); None where no row of the step runs one
    adapters: list[str] | None = None


class RunnerParts(Protocol):
    """What the layout reads of the ModelRunner (which imports this module)."""

    batch: InputBatch
    config: ModelRunnerConfig
    device: torch.device
    dtype: torch.dtype
    kv_cache: KVCache
    ops: ReferenceOps
    decode_graphs: DecodeGraphs | None


def prepare_inputs(runner: RunnerParts, so: SchedulerOutput) -> StepInputs:
    """The step's layout; ValueError where the diff schedules tokens the batch cannot hold."""
    batch, bs = runner.batch, runner.config.block_size
    req_ids = list(so.num_scheduled_tokens)
    rows = np.fromiter((batch.row(r) for r in req_ids), dtype=np.int64, count=len(req_ids))
    n = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
    c = batch.num_computed[rows]
    known = batch.num_tokens[rows]
    spec = so.spec_token_ids
    drafts = None
    if spec:  # the drafts sit after the known tokens for this step's inputs
        drafts = [spec.get(r, []) for r in req_ids]
        extra = np.fromiter(map(len, drafts), dtype=np.int64, count=len(req_ids))
        if (known + extra > batch.token_ids.shape[1]).any():
            raise ValueError("drafted tokens past max_model_len")
        for row, k, d in zip(rows.tolist(), known.tolist(), drafts, strict=True):
            if d:
                batch.token_ids[row, k : k + len(d)] = d
        known = known + extra
    if (n <= 0).any() or (c + n > known).any():
        bad = [r for r, a, b, k in zip(req_ids, c, n, known, strict=True) if b <= 0 or a + b > k]
        raise ValueError(f"scheduled tokens outside the known tokens for {bad}")
    if (c + n > bs * batch.num_blocks[rows]).any():
        raise ValueError("scheduled tokens past the end of a request's block table")
    total = int(n.sum())
    if total > runner.config.max_num_batched_tokens:
        raise ValueError(f"{total} tokens > max_num_batched_tokens")
    # decodes first, by context length; then prefill chunks. With the native decode kernel a
    # request verifying k drafts counts as a decode too: its 1 + k tokens become 1 + k decode
    # rows over its one block table, row j seeing the cache up to its own position (the step's
    # K/V are written before any row attends), so a step of decodes and verifications stays a
    # pure-decode step (the decode stack) instead of one chunk per verification.
    decode_like = n == 1
    verify_rows = drafts is not None and runner.ops.attention_kernel is not None
    if verify_rows:
        decode_like |= (c + n == known) & (n == 1 + extra) & (n * known <= MAX_VERIFY_ROW_READS)
    decodes = np.flatnonzero(decode_like)
    decodes = decodes[np.argsort(c[decodes], kind="stable")]
    order = np.concatenate([decodes, np.flatnonzero(~decode_like)])
    rows, n, c, known = rows[order], n[order], c[order], known[order]
    req_ids = [req_ids[i] for i in order.tolist()]
    if drafts is not None:
        drafts = [drafts[i] for i in order.tolist()]
    adapters = batch.lora_names(rows) if batch.num_lora_rows else None
    if adapters is not None and not any(adapters):
        adapters = None

    ends = np.cumsum(n)
    token_req = np.repeat(np.arange(len(rows)), n)
    positions = np.arange(total) - np.repeat(ends - n, n) + c[token_req]
    token_rows = rows[token_req]
    input_ids = batch.token_ids[token_rows, positions]
    slots = batch.block_table[token_rows, positions // bs] * bs + positions % bs
    sample_mask = c + n == known
    max_blocks = -(-int((c + n).max()) // bs)
    dev = runner.device
    logits_index = ends[sample_mask] - 1
    if drafts is not None:  # every position of a request with drafts
        counts = np.where(sample_mask, 1 + np.fromiter(map(len, drafts), np.int64), 0)
        firsts = np.repeat(ends - counts, counts)
        logits_index = (
            firsts + np.arange(len(firsts)) - np.repeat(np.cumsum(counts) - counts, counts)
        )
    graphs = runner.decode_graphs
    if (
        graphs is not None
        and adapters is None
        and len(decodes) == len(rows)
        and sample_mask.all()
        and graphs.bucket(len(rows), max_blocks) is not None
    ):
        table = batch.block_table[rows, :max_blocks]
        return StepInputs(
            req_ids=req_ids,
            rows=rows,
            num_scheduled=n,
            sample_mask=sample_mask,
            input_ids=torch.from_numpy(input_ids),
            positions=torch.from_numpy(positions),
            logits_index=torch.from_numpy(ends - 1),
            meta=None,
            graph_step=(input_ids, positions, slots, table, c + 1),
        )
    slot_mapping = torch.from_numpy(slots).to(dev, non_blocking=True)
    table_rows, meta_c, meta_n, num_decodes = rows, c, n, len(decodes)
    if verify_rows and len(decodes):  # one attention row per decode token (see above)
        num_decodes = int(ends[len(decodes) - 1])
        table_rows = np.concatenate([token_rows[:num_decodes], rows[len(decodes) :]])
        meta_c = np.concatenate([positions[:num_decodes], c[len(decodes) :]])
        meta_n = np.concatenate([np.ones(num_decodes, np.int64), n[len(decodes) :]])
    meta = attention.build_metadata(
        key_caches=runner.kv_cache.key_caches,
        value_caches=runner.kv_cache.value_caches,
        block_size=bs,
        block_table=batch.block_table[table_rows, :max_blocks],
        num_computed=meta_c,
        num_scheduled=meta_n,
        num_decodes=num_decodes,
        decode_group_size=runner.config.decode_group_size,
        slot_mapping=slot_mapping,
        dtype=runner.dtype,
        device=dev,
        decode_kernel=runner.ops.attention_kernel,
        native_prefill=runner.ops.native_prefill,
    )
    return StepInputs(
        req_ids=req_ids,
        rows=rows,
        num_scheduled=n,
        sample_mask=sample_mask,
        input_ids=torch.from_numpy(input_ids).to(dev, non_blocking=True),
        positions=torch.from_numpy(positions).to(dev, non_blocking=True),
        logits_index=torch.from_numpy(logits_index).to(dev, non_blocking=True),
        meta=meta,
        drafts=drafts,
        adapters=adapters,
    )
