"""The persistent batch: one row per running request, kept across steps and updated by diffs.

Rows live in preallocated numpy arrays (token ids, counters, block table, sampling parameters),
so a step reads the scheduled rows with fancy indexing and an unchanged row costs nothing.
A preempted request leaves its row but keeps its state (tokens, sampling params, generator,
penalty counts, LoRA adapter) here until it is resumed or finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.messages import SamplingParams
from worker_svc.sampler import SamplingMetadata


@dataclass(slots=True)
class RequestState:
    req_id: str
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None  # own generator when the request has a seed
    row: int | None = None  # None while preempted
    saved_token_ids: np.ndarray | None = None  # the tokens while preempted
    prompt_mask: torch.Tensor | None = None  # [V] bool, only with penalties
    output_counts: torch.Tensor | None = None  # [V] float, only with penalties
    lora_name: str = ""  # the LoRA adapter the request runs with; "" = the base model


def _has_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


class InputBatch:
    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_model_len: int,
        max_blocks_per_seq: int,
        num_kv_blocks: int,
        vocab_size: int,
        device: torch.device,
        max_logprobs: int,
    ) -> None:
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks
        self.vocab_size = vocab_size
        self.device = device
        self.max_logprobs = max_logprobs
        rows = max_num_seqs
        # +1: the token sampled at max_model_len is stored, though never computed
        self.token_ids = np.zeros((rows, max_model_len + 1), dtype=np.int64)
        self.num_tokens = np.zeros(rows, dtype=np.int64)  # known: prompt + output
        self.num_computed = np.zeros(rows, dtype=np.int64)
        self.block_table = np.zeros((rows, max_blocks_per_seq), dtype=np.int64)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.temperature = np.zeros(rows, dtype=np.float32)
        self.top_k = np.zeros(rows, dtype=np.int64)  # 0: off
        self.top_p = np.ones(rows, dtype=np.float32)
        self.min_p = np.zeros(rows, dtype=np.float32)
        self.num_logprobs = np.full(rows, -1, dtype=np.int64)  # -1: none
        self.row_state: list[RequestState | None] = [None] * rows
        self.free_rows = list(range(rows - 1, -1, -1))  # pop() hands out low rows first
        self.states: dict[str, RequestState] = {}
        self.num_lora_rows = 0  # rows whose request runs a LoRA adapter

    # --- diff application ---

    def add(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        params: SamplingParams,
        block_ids: Sequence[int],
        num_computed: int,
        lora_name: str = "",
    ) -> None:
        """A new request (or one re-sent in full, which replaces what was known of it)."""
        self.remove(req_id)
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(f"{req_id}: logprobs={params.logprobs} > {self.max_logprobs}")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        state = RequestState(req_id, len(prompt_token_ids), params, generator, lora_name=lora_name)
        tokens = np.asarray([*prompt_token_ids, *output_token_ids], dtype=np.int64)
        self.states[req_id] = state
        self._place(state, tokens, block_ids, num_computed)

    def remove(self, req_id: str) -> None:
        """A finished (or aborted) request: forget it. Unknown ids are ignored."""
        state = self.states.pop(req_id, None)
        if state is not None and state.row is not None:
            self._free(state)

    def preempt(self, req_id: str) -> None:
        """Leave the batch, keep the tokens for a later resume. Unknown ids are ignored."""
        state = self.states.get(req_id)
        if state is None or state.row is None:
            return
        row = state.row
        state.saved_token_ids = self.token_ids[row, : self.num_tokens[row]].copy()
        self._free(state)

    def resume(
        self,
        req_id: str,
        block_ids: Sequence[int],
        num_computed: int,
        output_token_ids: Sequence[int],
    ) -> None:
        """Back in the batch with a full new block table; its outputs replaced by the diff's."""
        state = self._state(req_id)
        if state.row is not None:
            tokens = self.token_ids[state.row, : self.num_tokens[state.row]].copy()
            self._free(state)
        else:
            assert state.saved_token_ids is not None
            tokens = state.saved_token_ids
        state.saved_token_ids = None
        prompt = tokens[: state.num_prompt_tokens]
        tokens = np.concatenate([prompt, np.asarray(output_token_ids, dtype=np.int64)])
        self._place(state, tokens, block_ids, num_computed)

    def append_blocks(self, req_id: str, block_ids: Sequence[int]) -> None:
        row = self.row(req_id)
        n, k = int(self.num_blocks[row]), len(block_ids)
        if n + k > self.block_table.shape[1]:
            raise ValueError(f"{req_id}: {n + k} blocks exceed max_model_len")
        self._check_block_ids(req_id, block_ids)
        self.block_table[row, n : n + k] = block_ids
        self.num_blocks[row] = n + k

    def set_num_computed(self, req_id: str, num_computed: int) -> None:
        row = self.row(req_id)
        if not 0 <= num_computed <= self.num_tokens[row]:
            raise ValueError(f"{req_id}: num_computed_tokens {num_computed} out of range")
        self.num_computed[row] = num_computed

    def row(self, req_id: str) -> int:
        row = self._state(req_id).row
        if row is None:
            raise KeyError(f"request {req_id!r} is preempted; it needs a resumed entry first")
        return row

    def lora_names(self, rows: np.ndarray) -> list[str]:
        """Each row's LoRA adapter ("" = the base model)."""
        return [self.row_state[r].lora_name for r in rows.tolist()]

    def clear(self) -> None:
        for req_id in list(self.states):
            self.remove(req_id)

    def held_requests(self) -> list[tuple[str, list[int], int, int]]:
        """Each request with a row: (request id, block table, tokens whose KV the cache holds,
        tokens known). Preempted (and swapped-out) requests have no row: not held."""
        return [
            (
                state.req_id,
                self.block_table[row, : self.num_blocks[row]].tolist(),
                int(self.num_computed[row]),
                int(self.num_tokens[row]),
            )
            for row, state in enumerate(self.row_state)
            if state is not None
        ]

    # --- after a step ---

    def append_tokens(self, rows: np.ndarray, tokens: list[int]) -> None:
        """Store each row's sampled token (and count it for penalties)."""
        n = self.num_tokens[rows]
        self.token_ids[rows, n] = tokens
        self.num_tokens[rows] = n + 1
        for row, tok in zip(rows.tolist(), tokens, strict=True):
            state = self.row_state[row]
            if state is not None and state.output_counts is not None:
                state.output_counts[tok] += 1

    def keep_verified(
        self, row: int, tokens: list[int], num_rejected: int, block_size: int
    ) -> None:
        """A row that scored drafts: the rejected positions' KV is garbage (computed again when
        reached), and the blocks past its computed tokens go, as the scheduler's kv.trim gives
        them back; then its kept tokens are stored."""
        if num_rejected:
            self.num_computed[row] -= num_rejected
            keep = -(-int(self.num_computed[row]) // block_size)
            self.num_blocks[row] = min(int(self.num_blocks[row]), keep)
        one = np.array([row])
        for tok in tokens:
            self.append_tokens(one, [tok])

    def sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """The sampling parameters of `rows` (in this order) as tensors; None where unused."""
        dev = self.device
        meta = SamplingMetadata(num_rows=len(rows))
        temp = self.temperature[rows]
        states = [self.row_state[r] for r in rows.tolist()]
        if (temp != 0).any():
            rand = temp != 0
            meta.all_greedy = False
            meta.temperature = torch.from_numpy(temp).to(dev)
            top_k = self.top_k[rows]
            if (rand & (top_k > 0)).any():
                k = np.where(
                    rand & (top_k > 0), np.minimum(top_k, self.vocab_size), self.vocab_size
                )
                meta.top_k = torch.from_numpy(k).to(dev)
            top_p = self.top_p[rows]
            if (rand & (top_p < 1)).any():
                meta.top_p = torch.from_numpy(np.where(rand, top_p, 1).astype(np.float32)).to(dev)
            min_p = self.min_p[rows]
            if (rand & (min_p > 0)).any():
                meta.min_p = torch.from_numpy(np.where(rand, min_p, 0).astype(np.float32)).to(dev)
            meta.generators = {
                i: s.generator for i, s in enumerate(states) if s.generator is not None and rand[i]
            }
        pen = [i for i, s in enumerate(states) if s.output_counts is not None]
        if pen:
            params = [states[i].params for i in pen]
            meta.penalty_rows = torch.tensor(pen, dtype=torch.int64, device=dev)
            meta.presence = torch.tensor([p.presence_penalty for p in params], device=dev)
            meta.frequency = torch.tensor([p.frequency_penalty for p in params], device=dev)
            meta.repetition = torch.tensor([p.repetition_penalty for p in params], device=dev)
            meta.prompt_mask = torch.stack([states[i].prompt_mask for i in pen])
            meta.output_counts = torch.stack([states[i].output_counts for i in pen])
        num_logprobs = self.num_logprobs[rows]
        if (num_logprobs >= 0).any():
            meta.num_logprobs = [int(n) if n >= 0 else None for n in num_logprobs.tolist()]
        return meta

    # --- internals ---

    def _state(self, req_id: str) -> RequestState:
        state = self.states.get(req_id)
        if state is None:
            raise KeyError(f"unknown request {req_id!r}: the worker never got it as new")
        return state

    def _place(
        self, state: RequestState, tokens: np.ndarray, block_ids: Sequence[int], num_computed: int
    ) -> None:
        req_id, n = state.req_id, len(tokens)
        if n == 0 or n > self.max_model_len:
            raise ValueError(f"{req_id}: {n} tokens, needs 1..max_model_len={self.max_model_len}")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size:
            raise ValueError(f"{req_id}: token id outside the vocabulary [0, {self.vocab_size})")
        if len(block_ids) > self.block_table.shape[1]:
            raise ValueError(f"{req_id}: {len(block_ids)} blocks exceed max_model_len")
        self._check_block_ids(req_id, block_ids)
        if not 0 <= num_computed <= n:
            raise ValueError(f"{req_id}: num_computed_tokens {num_computed} > {n} known tokens")
        if not self.free_rows:
            raise ValueError(f"{req_id}: the batch is full (max_num_seqs rows)")
        row = self.free_rows.pop()
        state.row = row
        self.row_state[row] = state
        self.num_lora_rows += bool(state.lora_name)
        self.token_ids[row, :n] = tokens
        self.num_tokens[row] = n
        self.num_computed[row] = num_computed
        self.block_table[row, : len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)
        p = state.params
        self.temperature[row] = p.temperature
        self.top_k[row] = p.top_k
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        if _has_penalties(p):
            t = torch.from_numpy(tokens).to(self.device)
            state.prompt_mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            state.prompt_mask[t[: state.num_prompt_tokens]] = True
            state.output_counts = torch.bincount(
                t[state.num_prompt_tokens :], minlength=self.vocab_size
            ).float()

    def _check_block_ids(self, req_id: str, block_ids: Sequence[int]) -> None:
        if block_ids and not (0 <= min(block_ids) and max(block_ids) < self.num_kv_blocks):
            raise ValueError(f"{req_id}: block id outside the KV cache [0, {self.num_kv_blocks})")

    def _free(self, state: RequestState) -> None:
        row = state.row
        assert row is not None
        self.row_state[row] = None
        self.num_lora_rows -= bool(state.lora_name)
        self.block_table[row] = 0  # stale ids past a row's length are gathered (and masked)
        self.num_blocks[row] = 0
        self.free_rows.append(row)
        state.row = None
