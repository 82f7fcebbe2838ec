"""Admission: swapped-out requests resume first, then waiting requests in policy order.

Runs only in a step that preempted nothing. A waiting request whose reason not to run now is its
own (chunked prefill off and its prompt does not fit the budget left) is skipped and keeps its
place; one that fails block allocation (the pool is full, watermark kept) ends admission for
the step. A request the policy holds back (``policy.admits``: goodput keeps requests off the
worker that would cost deadlines) is skipped the same way, and so is a waiting or swapped
request whose LoRA adapter finds no slot, or whom a starving adapter keeps back (lora_slots.py).
Admitted requests start at their prefix-cache hit (whole blocks, free of budget).
"""

from __future__ import annotations

from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.lora_slots import AdapterBook, StepAdapterSlots, has_slot
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.request_queue import RequestQueue
from scheduler_svc.core.scheduler_config import SchedulerConfig
from scheduler_svc.core.stats import SchedulerCounters
from scheduler_svc.core.step_state import StepState
from scheduler_svc.core.worker_view import WorkerView

_RUNNING = RequestStatus.RUNNING


class WaitingAdmitter:
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
        counters: SchedulerCounters,
        adapters: AdapterBook,
    ) -> None:
        self.config = config
        self.kv = kv
        self.running = running
        self.running_by_id = running_by_id
        self.waiting = waiting
        self.swapped = swapped
        self.worker_view = worker_view
        self.counters = counters
        self.adapters = adapters
        self._slots: StepAdapterSlots | None = None  # this step's, once an adapter is met
        self.block_size = config.block_size
        self.caching = config.enable_prefix_caching
        self.threshold = config.long_prefill_token_threshold if config.enable_chunked_prefill else 0
        self.watermark_blocks = config.watermark_blocks

    def swapped_head_admitted(self) -> bool:
        head = self.swapped.peek()
        if head is None or not self.swapped.policy.admits(head):
            return False
        return not head.lora_name or has_slot(head, self.running, self.config.max_loras)

    def has_seat(self, head: Request) -> bool:
        """Admission would find a seat, the policy's consent and the blocks of its first step
        for this waiting request (prefix-cache hits not counted: a seat too few is the safe
        error, it only unseats a request that can no longer count)."""
        cfg = self.config
        if len(self.running) >= cfg.max_num_seqs or not self.waiting.policy.admits(head):
            return False
        if head.lora_name and not has_slot(head, self.running, cfg.max_loras):
            return False
        if self.swapped and self.swapped_head_admitted():
            return False  # the swapped request resumes first
        n = min(head.num_tokens, cfg.max_num_batched_tokens)
        if self.threshold:
            n = min(n, self.threshold)
        need = -(-n // self.block_size)
        reserve = self.watermark_blocks if self.running else 0
        return need + reserve <= self.kv.num_free_blocks

    def resume_swapped(self, step: StepState) -> None:
        """Resume swapped-out requests (head first) while budget, seats, blocks and the policy
        allow."""
        cfg = self.config
        swapped, running = self.swapped, self.running
        threshold = self.threshold
        admits = swapped.policy.admits
        skipped: list[Request] = []
        budget = step.budget
        while budget > 0 and len(running) < cfg.max_num_seqs and swapped:
            req = swapped.peek()
            assert req is not None
            if not admits(req):
                break  # held back (goodput: a request unseated while hopeless); waiting goes on
            if req.lora_name and not self._adapter_slots(step).admits(req):
                skipped.append(swapped.pop())  # no slot for its adapter: the next one may go
                continue
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
            reserve = self.watermark_blocks if running else 0
            pairs = self.kv.swap_in(req, n, reserve)
            if pairs is None:
                break
            swapped.pop()
            rid = req.request_id
            step.swap_in += pairs
            self.counters.num_swap_ins += 1
            if req.lora_name:
                self._took_adapter(req, step)
            req.status = _RUNNING
            req.admitted_step = step.step_id
            running.append(req)
            self.running_by_id[rid] = req
            # a request swapped out before the worker heard of it (adopted, preempted at once)
            # travels as new
            self.worker_view.send(req, self.kv.block_ids(rid), c, step)
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
        for req in reversed(skipped):
            swapped.prepend(req)

    def admit_waiting(self, step: StepState) -> None:
        cfg = self.config
        waiting, running, kv = self.waiting, self.running, self.kv
        bs = self.block_size
        chunked = cfg.enable_chunked_prefill
        threshold = self.threshold
        max_seqs = cfg.max_num_seqs
        max_budget = cfg.max_num_batched_tokens
        max_skips = cfg.max_waiting_skips_per_step
        finished_pending = self.worker_view.finished
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
            if not admits(req) or (  # held back by the policy this step: keeps its place
                req.lora_name and not self._adapter_slots(step).admits(req)
            ):  # ... or by its adapter (no slot, or another adapter is starving)
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
            reserve = self.watermark_blocks if running else 0
            if kv.allocate_slots(req, n, hits, reserve) is None:
                skipped.append(req)  # the pool is full: stop admitting for this step
                break
            self._admit(req, n, num_hit, total, step)
            if req.lora_name:
                self._took_adapter(req, step)
            budget -= n
            step.budget = budget
        for req in reversed(skipped):
            waiting.prepend(req)

    def _adapter_slots(self, step: StepState) -> StepAdapterSlots:
        slots = self._slots
        if slots is None or slots.step_id != step.step_id:
            cfg = self.config
            slots = self._slots = StepAdapterSlots(
                step.step_id, cfg.max_loras, cfg.lora_starvation_steps, self.running
            )
        return slots

    def _took_adapter(self, req: Request, step: StepState) -> None:
        self._adapter_slots(step).took(req)
        unfinished = len(self.running) + len(self.waiting) + len(self.swapped)
        self.adapters.note(req, unfinished)

    def _admit(self, req: Request, n: int, num_hit: int, total: int, step: StepState) -> None:
        rid = req.request_id
        req.status = _RUNNING
        req.admitted_step = step.step_id
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
        counters = self.counters
        if self.caching:
            counters.prefix_cache_queries += total
            counters.prefix_cache_hits += num_hit
        self.running.append(req)
        self.running_by_id[rid] = req
        self.worker_view.send(req, self.kv.block_ids(rid), num_hit, step)
        step.num_scheduled[rid] = n
        step.reqs.append(req)
        step.ns.append(n)
        counters.count_computed(req, num_hit, n)
        req.num_computed_tokens = num_hit + n
        samples = num_hit + n == total
        if samples:
            req.num_output_placeholders += 1
        step.samples.append(samples)
        if n == 1 and num_hit + 1 == total and req.output_token_ids:
            step.num_decode += 1
