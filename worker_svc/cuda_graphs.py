"""CUDA graphs for pure-decode steps: the model's whole forward captured once per shape, replayed.

A decode step on a GPU launches a few hundred small kernels, and at small batches launching them
takes longer than running them. A captured graph launches them all at once. A graph has fixed
shapes, so a step is padded up to a bucket: the row count to the next of `batch_buckets()`, the
block table to the next width of `width_buckets()`. Padded rows decode token 0 at position 0
into the KV cache's scratch block, attend to it alone, and their logits are dropped; padded
block-table columns point at the scratch block and are masked out by each row's length. The
attention of a captured step is `attention.PaddedDecode`: gather the fixed-width block table,
SDPA with a length mask. Everything else is the model's own code (worker_svc/model/llama.py).

A graph is captured the first time its bucket is used, on the runner's stream, after one eager
run that sets up the kernels' workspaces; graphs share one memory pool. `capture=False` runs the
same padded step eagerly: the CPU tests check the padding and masks that way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from worker_svc.attention import AttentionMetadata, PaddedDecode
from worker_svc.kv_cache import KVCache
from worker_svc.model.llama import CausalLM

log = logging.getLogger("splitserve.worker.cuda_graphs")

MAX_BATCH = 256  # decode steps of more rows run eagerly (their launches are a small share)


def batch_buckets(max_rows: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, MAX_BATCH + 1, 16))
    return [s for s in sizes if s < max_rows] + [min(max_rows, MAX_BATCH)]


def width_buckets(max_blocks: int) -> list[int]:
    """Block-table widths: powers of 4 blocks from 16, then the longest sequence's."""
    widths, w = [], 16
    while w < max_blocks:
        widths.append(w)
        w *= 4
    return [*widths, max_blocks]


@dataclass(slots=True)
class _Static:
    """One bucket's fixed inputs and output, and its graph once captured."""

    input_ids: torch.Tensor  # [rows]
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor  # [rows, width]
    seq_lens: torch.Tensor  # [rows]
    logits: torch.Tensor | None = None  # [rows, vocab]
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        max_rows: int,
        max_blocks_per_seq: int,
        capture: bool,
    ) -> None:
        if kv_cache.scratch_block is None:
            raise ValueError("decode graphs need the KV cache's scratch block")
        self.model, self.kv_cache, self.capture = model, kv_cache, capture
        self.device = kv_cache.device
        self.batches = batch_buckets(max_rows)
        self.widths = width_buckets(max_blocks_per_seq)
        self.scratch = kv_cache.scratch_block
        self._static: dict[tuple[int, int], _Static] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0

    def bucket(self, rows: int, blocks: int) -> tuple[int, int] | None:
        """The (rows, width) bucket a decode step of `rows` rows over at most `blocks` blocks
        each pads up to; None past the largest."""
        b = next((b for b in self.batches if b >= rows), None)
        w = next((w for w in self.widths if w >= blocks), None)
        return None if b is None or w is None else (b, w)

    def run(
        self,
        input_ids: np.ndarray,  # [n] int64
        positions: np.ndarray,
        slots: np.ndarray,
        block_table: np.ndarray,  # [n, >= blocks] int64
        seq_lens: np.ndarray,  # [n]: positions + 1
    ) -> torch.Tensor | None:
        """Logits [n, vocab] of a pure-decode step where every row samples; None where no bucket
        takes it (the caller runs the step eagerly)."""
        n = len(input_ids)
        blocks = -(-int(seq_lens.max()) // self.kv_cache.block_size)
        key = self.bucket(n, blocks)
        if key is None:
            return None
        rows, width = key
        static = self._static.get(key) or self._make(rows, width)
        static.input_ids.copy_(_padded(input_ids, rows, 0))
        static.positions.copy_(_padded(positions, rows, 0))
        bs = self.kv_cache.block_size
        static.slot_mapping.copy_(_padded(slots, rows, self.scratch * bs))
        table = np.full((rows, width), self.scratch, dtype=np.int64)
        table[:n, :blocks] = block_table[:, :blocks]
        static.block_table.copy_(torch.from_numpy(table))
        static.seq_lens.copy_(_padded(seq_lens, rows, 1))
        if static.graph is None and self.capture:
            self._capture(static)
        if static.graph is not None:
            static.graph.replay()  # after a capture too: recording runs nothing
            self.replays += 1
        else:
            static.logits = self._forward(static)
        return static.logits[:n]

    def _make(self, rows: int, width: int) -> _Static:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=self.device)

        static = _Static(zeros(rows), zeros(rows), zeros(rows), zeros(rows, width), zeros(rows))
        self._static[(rows, width)] = static
        return static

    def _forward(self, s: _Static) -> torch.Tensor:
        cache = self.kv_cache
        span = s.block_table.shape[1] * cache.block_size
        key_index = torch.arange(span, device=self.device)
        mask = (key_index[None, :] < s.seq_lens[:, None]).view(len(s.seq_lens), 1, 1, span)
        meta = AttentionMetadata(
            key_caches=cache.key_caches,
            value_caches=cache.value_caches,
            block_size=cache.block_size,
            slot_mapping=s.slot_mapping,
            padded_decode=PaddedDecode(s.block_table, mask),
        )
        rows = torch.arange(len(s.input_ids), device=self.device)
        return self.model(s.input_ids, s.positions, rows, meta)

    def _capture(self, s: _Static) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(s)  # sets up the kernels' workspaces (its K/V writes are rewritten)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            s.logits = self._forward(s)
        s.graph = graph
        log.info(
            "captured the decode step for %d rows x %d blocks (%d graphs)",
            len(s.input_ids),
            s.block_table.shape[1],
            sum(st.graph is not None for st in self._static.values()),
        )


def _padded(values: np.ndarray, rows: int, fill: int) -> torch.Tensor:
    out = np.full(rows, fill, dtype=np.int64)
    out[: len(values)] = values
    return torch.from_numpy(out)
