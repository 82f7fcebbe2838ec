"""Admission: swapped-out requests resume first, then waiting requests in policy order.

Runs only in a step that preempted nothing. A waiting request whose reason not to run now is its
own (chunked prefill off and its prompt does not fit the budget left) is skipped and keeps its
place; one that fails block allocation (the pool is full, watermark kept) ends admission for
the step. A request the policy holds back (``policy.admits``: goodput keeps requests off the
worker that would cost deadlines) is skipped the same way. Admitted requests start at
their prefix-cache hit (whole blocks, free of budget).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.messages import CachedRequestData, NewRequestData
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.step_state import StepState

if TYPE_CHECKING:
    from scheduler_svc.core.config import SchedulerConfig
    from scheduler_svc.core.kv_cache_manager import KVCacheManager
    from scheduler_svc.core.request_queue import RequestQueue

_RUNNING = RequestStatus.RUNNING


class AdmissionMixin:
    """Part of Scheduler (kept in its own file): the admission phase of schedule()."""

    config: SchedulerConfig
    kv: KVCacheManager
    waiting: RequestQueue
    swapped: RequestQueue
    running: list[Request]
    _running_by_id: dict[str, Request]
    _worker_known: set[str]
    _finished_pending: set[str]
    _block_size: int
    _caching: bool
    _threshold: int
    _watermark_blocks: int
    _prefix_queries: int
    _prefix_hits: int
    _num_swap_ins: int

    def _note_computed(self, req: Request, c: int, n: int) -> None: ...

    def _schedule_swapped(self, step: StepState) -> None:
        """Resume swapped-out requests (head first) while budget, seats, blocks and the policy
        allow."""
        cfg = self.config
        swapped, running = self.swapped, self.running
        threshold = self._threshold
        admits = swapped.policy.admits
        budget = step.budget
        while budget > 0 and len(running) < cfg.max_num_seqs and swapped:
            req = swapped.peek()
            assert req is not None
            if not admits(req):
                break  # held back (goodput: a request unseated while hopeless); waiting goes on
            c = req.num_computed_tokens
            total = req.num_tokens + req.num_output_placeholders
            n = total - c
            if n <= 0:
                break  # its last step has not come back yet
            if threshold and n > threshold:
                n = threshold
            if n > budget:
                if not cfg.enable_chunked_prefill and n <= cfg.max_num_batched_tokens:
                    break  # runs whole in a later step
                n = budget
            reserve = self._watermark_blocks if running else 0
            pairs = self.kv.swap_in(req, n, reserve)
            if pairs is None:
                break
            swapped.pop()
            rid = req.request_id
            step.swap_in += pairs
            self._num_swap_ins += 1
            req.status = _RUNNING
            req.admitted_step = step.step_id
            running.append(req)
            self._running_by_id[rid] = req
            if rid in self._worker_known:
                step.cached_reqs.append(
                    CachedRequestData(
                        rid,
                        self.kv.block_ids(rid),
                        c,
                        resumed=True,
                        new_token_ids=list(req.output_token_ids),
                    )
                )
            else:  # swapped out before the worker heard of it (adopted, preempted at once)
                self._worker_known.add(rid)
                step.new_reqs.append(
                    NewRequestData(
                        rid,
                        req.prompt_token_ids,
                        req.sampling_params,
                        self.kv.block_ids(rid),
                        c,
                        list(req.output_token_ids),
                    )
                )
            step.num_scheduled[rid] = n
            step.reqs.append(req)
            step.ns.append(n)
            req.num_computed_tokens = c + n
            samples = c + n == total
            if samples:
                req.num_output_placeholders += 1
            step.samples.append(samples)
            budget -= n
            if n == 1 and c + 1 == total and req.output_token_ids:
                step.num_decode += 1
        step.budget = budget

    def _schedule_waiting(self, step: StepState) -> None:
        cfg = self.config
        waiting, running, kv = self.waiting, self.running, self.kv
        bs = self._block_size
        chunked = cfg.enable_chunked_prefill
        threshold = self._threshold
        max_seqs = cfg.max_num_seqs
        max_budget = cfg.max_num_batched_tokens
        max_skips = cfg.max_waiting_skips_per_step
        finished_pending = self._finished_pending
        admits = waiting.policy.admits
        skipped: list[Request] = []
        budget = step.budget
        while budget > 0 and len(running) < max_seqs and waiting:
            req = waiting.pop()
            if req.request_id in finished_pending:
                # an earlier request with this id ends in this very step: admit it next step,
                # so the worker never sees one id both finished and new in one diff
                skipped.append(req)
                if len(skipped) >= max_skips:
                    break
                continue
            if not admits(req):  # held back by the policy this step: keeps its place
                skipped.append(req)
                if len(skipped) >= max_skips:
                    break
                continue
            hits = kv.find_cached_prefix(req)
            num_hit = len(hits) * bs
            total = req.num_tokens + req.num_output_placeholders
            n = total - num_hit
            if chunked:
                if threshold and n > threshold:
                    n = threshold
                if n > budget:
                    n = budget
            elif n > budget:
                if n <= max_budget:  # runs whole in a later step; let shorter ones go first
                    skipped.append(req)
                    if len(skipped) >= max_skips:
                        break
                    continue
                n = budget  # (resumed/migrated) longer than any step: chunk it after all
            reserve = self._watermark_blocks if running else 0
            if kv.allocate_slots(req, n, hits, reserve) is None:
                skipped.append(req)  # the pool is full: stop admitting for this step
                break
            self._admit(req, n, num_hit, total, step)
            budget -= n
            step.budget = budget
        for req in reversed(skipped):
            waiting.prepend(req)

    def _admit(self, req: Request, n: int, num_hit: int, total: int, step: StepState) -> None:
        rid = req.request_id
        req.status = _RUNNING
        req.admitted_step = step.step_id
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
        if self._caching:
            self._prefix_queries += total
            self._prefix_hits += num_hit
        self.running.append(req)
        self._running_by_id[rid] = req
        block_ids = self.kv.block_ids(rid)
        if rid in self._worker_known:
            step.cached_reqs.append(
                CachedRequestData(
                    rid, block_ids, num_hit, resumed=True, new_token_ids=list(req.output_token_ids)
                )
            )
        else:
            self._worker_known.add(rid)
            step.new_reqs.append(
                NewRequestData(
                    rid,
                    req.prompt_token_ids,
                    req.sampling_params,
                    block_ids,
                    num_hit,
                    list(req.output_token_ids),
                )
            )
        step.num_scheduled[rid] = n
        step.reqs.append(req)
        step.ns.append(n)
        self._note_computed(req, num_hit, n)
        req.num_computed_tokens = num_hit + n
        samples = num_hit + n == total
        if samples:
            req.num_output_placeholders += 1
        step.samples.append(samples)
        if n == 1 and num_hit + 1 == total and req.output_token_ids:
            step.num_decode += 1
