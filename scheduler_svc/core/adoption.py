"""Adoption: a new leader takes over the requests a worker still holds, without recompute.

After a failover each worker reports the rows of its persistent batch: a request, its KV block
table and how many tokens that KV holds. The worker has forgotten the rows (it resets on losing
its link) but kept its KV cache. adopt_request() puts such a request straight into the running
set holding exactly the blocks of its computed tokens, as a prefix-cache hit would; its next
schedule() sends it to the worker as new, with the full block table and num_computed_tokens, and
computes only the tokens after them.
"""

from __future__ import annotations

from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.request_queue import RequestQueue
from scheduler_svc.core.scheduler_config import SchedulerConfig
from scheduler_svc.core.validation import validate_request
from scheduler_svc.core.worker_view import WorkerView


class Adopter:
    def __init__(
        self,
        *,
        config: SchedulerConfig,
        kv: KVCacheManager,
        running: list[Request],
        running_by_id: dict[str, Request],
        waiting: RequestQueue,
        swapped: RequestQueue,
        worker_view: WorkerView,
    ) -> None:
        self.config = config
        self.kv = kv
        self.running = running
        self.running_by_id = running_by_id
        self.waiting = waiting
        self.swapped = swapped
        self.worker_view = worker_view

    def adopt(
        self, request: Request, block_ids: list[int], num_computed_tokens: int, step_id: int
    ) -> None:
        """Scheduler.adopt_request(), the next step to be scheduled being ``step_id``."""
        cfg = self.config
        validate_request(request, cfg)
        rid = request.request_id
        if rid in self.running_by_id or rid in self.waiting or rid in self.swapped:
            raise ValueError(f"request id {rid!r} is already in flight here; adopt it once")
        c = num_computed_tokens
        if not 0 <= c < request.num_tokens:
            raise ValueError(
                f"request {rid!r} has {request.num_tokens} tokens, so at most "
                f"{request.num_tokens - 1} can be adopted as computed, not {c}"
            )
        if len(self.running) >= cfg.max_num_seqs:
            raise ValueError(
                f"cannot adopt request {rid!r}: {len(self.running)} requests already run here "
                f"(max_num_seqs={cfg.max_num_seqs})"
            )
        num_blocks = -(-c // cfg.block_size)
        if len(block_ids) < num_blocks:
            raise ValueError(
                f"request {rid!r}: {c} computed tokens need {num_blocks} blocks of "
                f"{cfg.block_size} tokens but its table has {len(block_ids)}"
            )
        self.kv.adopt(request, block_ids, num_blocks)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = c
        request.max_computed_tokens = c  # held, not recomputed
        request.num_output_placeholders = 0
        request.finish_reason = None
        request.stop_reason = None
        request.admitted_step = step_id  # outputs of earlier steps are not its own
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = c
        self.running.append(request)
        self.running_by_id[rid] = request
        self.worker_view.known.discard(rid)
        # the worker forgot its row: sent as new when first scheduled
        self.worker_view.adopted_unsent.add(rid)
