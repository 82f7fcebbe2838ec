"""Adoption: a new leader takes over the requests a worker still holds, without recompute.

After a failover each worker reports the rows of its persistent batch: a request, its KV block
table and how many tokens that KV holds. The worker has forgotten the rows (it resets on losing
its link) but kept its KV cache. adopt_request() puts such a request straight into the running
set holding exactly the blocks of its computed tokens, as a prefix-cache hit would; its next
schedule() sends it to the worker as new, with the full block table and num_computed_tokens, and
computes only the tokens after them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.validation import validate_request

if TYPE_CHECKING:
    from scheduler_svc.core.config import SchedulerConfig
    from scheduler_svc.core.kv_cache_manager import KVCacheManager
    from scheduler_svc.core.request_queue import RequestQueue


class AdoptionMixin:
    """Part of Scheduler (kept in its own file): adopt_request()."""

    config: SchedulerConfig
    kv: KVCacheManager
    waiting: RequestQueue
    swapped: RequestQueue
    running: list[Request]
    _running_by_id: dict[str, Request]
    _worker_known: set[str]
    _adopted_unsent: set[str]
    _block_size: int
    _num_steps: int

    def adopt_request(
        self, request: Request, block_ids: list[int], num_computed_tokens: int
    ) -> None:
        """Run ``request`` from its first ``num_computed_tokens`` tokens, whose KV the worker
        holds in ``block_ids`` (its block table, in token order). The request joins the running
        set at once holding the blocks those tokens need (taken out of the free pool, or shared
        with another adopted request that holds them); table entries beyond them stay free.

        num_computed_tokens must be below request.num_tokens (the last token is always computed
        to sample the next; pass min(what the worker holds, num_tokens - 1)). Raises
        RequestRejected when the request could never run here, ValueError (changing nothing)
        when the running set is full (max_num_seqs), the id is already here, or the table
        cannot hold those tokens here."""
        validate_request(request, self.config)
        rid = request.request_id
        if rid in self._running_by_id or rid in self.waiting or rid in self.swapped:
            raise ValueError(f"request id {rid!r} is already in flight here; adopt it once")
        c = num_computed_tokens
        if not 0 <= c < request.num_tokens:
            raise ValueError(
                f"request {rid!r} has {request.num_tokens} tokens, so at most "
                f"{request.num_tokens - 1} can be adopted as computed, not {c}"
            )
        if len(self.running) >= self.config.max_num_seqs:
            raise ValueError(
                f"cannot adopt request {rid!r}: {len(self.running)} requests already run here "
                f"(max_num_seqs={self.config.max_num_seqs})"
            )
        num_blocks = -(-c // self._block_size)
        if len(block_ids) < num_blocks:
            raise ValueError(
                f"request {rid!r}: {c} computed tokens need {num_blocks} blocks of "
                f"{self._block_size} tokens but its table has {len(block_ids)}"
            )
        self.kv.adopt(request, block_ids, num_blocks)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = c
        request.max_computed_tokens = c  # held, not recomputed
        request.num_output_placeholders = 0
        request.finish_reason = None
        request.stop_reason = None
        request.admitted_step = self._num_steps  # outputs of earlier steps are not its own
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = c
        self.running.append(request)
        self._running_by_id[rid] = request
        self._worker_known.discard(rid)
        self._adopted_unsent.add(rid)  # the worker forgot its row: sent as new when scheduled
