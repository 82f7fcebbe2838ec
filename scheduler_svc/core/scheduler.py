"""The Scheduler: one per worker. Each step decides which requests compute how many tokens.

One progress model: a request's ``num_computed_tokens`` chases its ``num_tokens`` (prompt +
output; "tokens known"), so prefill, chunked prefill, prefix-cache hits and decode are the same
loop. ``num_computed_tokens`` is advanced in schedule(), right when the step is decided (as vLLM
V1 does); update_from_output() then appends the sampled tokens, checks stop conditions and
registers the blocks the step filled in the prefix cache.

A step: running requests first (in admission order), each gets min(remaining, budget) tokens; if
its KV blocks cannot be allocated, victims chosen by the policy are preempted (recompute: blocks
freed, progress reset, back to the head of waiting) until it fits or it is the victim itself; a
victim already scheduled this step gives its tokens back. Then, unless something was preempted,
waiting requests are admitted in policy order while budget, max_num_seqs and blocks (keeping the
watermark free) allow. The result is a SchedulerOutput diff for the worker.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from scheduler_svc.core.block_pool import KVCacheBlock
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.errors import RequestRejected, SchedulerConfigError
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.outputs import (
    CachedRequestData,
    NewRequestData,
    RequestOutput,
    SchedulerOutput,
)
from scheduler_svc.core.policy import create_policy
from scheduler_svc.core.request import FinishReason, Request, RequestStatus
from scheduler_svc.core.request_queue import RequestQueue, create_request_queue
from scheduler_svc.core.stats import SchedulerStats
from scheduler_svc.core.stopping import check_stop
from scheduler_svc.core.validation import validate_request

_RUNNING = RequestStatus.RUNNING


@dataclass(slots=True)
class _Step:
    """What one schedule() call has decided so far."""

    step_id: int
    budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    num_decode: int = 0
    reqs: list[Request] = field(default_factory=list)  # scheduled, parallel to ns
    ns: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, waiting_queue: RequestQueue | None = None):
        self.config = config
        if waiting_queue is None:
            self.policy = create_policy(config.policy)
            waiting_queue = create_request_queue(self.policy)
        else:
            self.policy = waiting_queue.policy
            if self.policy.name != config.policy:
                raise SchedulerConfigError(
                    f"the shared waiting queue orders by policy {self.policy.name!r} but this "
                    f"scheduler is configured with {config.policy!r}; use the same policy"
                )
        self.waiting: RequestQueue = waiting_queue
        self.running: list[Request] = []  # admission order
        self._running_by_id: dict[str, Request] = {}
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self._block_size = config.block_size
        self._caching = config.enable_prefix_caching
        self._threshold = (
            config.long_prefill_token_threshold if config.enable_chunked_prefill else 0
        )
        self._watermark_blocks = config.watermark_blocks
        # a request ends with LENGTH when its tokens reach max_model_len, or when computing its
        # next token would need more KV than the whole pool holds (it could never run alone)
        self._length_limit = min(config.max_model_len, config.kv_capacity_tokens + 1)
        self._worker_known: set[str] = set()  # sent to the worker as new and not finished since
        self._finished_pending: set[str] = set()  # finished/aborted, reported by next schedule()
        # the last output and its scheduled requests: update_from_output() walks these instead
        # of looking every id up (a fallback handles any other SchedulerOutput object)
        self._last_out: SchedulerOutput | None = None
        self._last_reqs: list[Request] = []
        self._last_ns: list[int] = []
        # counters
        self._num_steps = 0
        self._num_preemptions = 0
        self._num_recomputed = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._num_prefill_tokens = 0
        self._num_decode_tokens = 0
        self._num_finished = 0
        self._num_aborted = 0

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises RequestRejected (with a sentence) if it can never run."""
        validate_request(request, self.config)
        rid = request.request_id
        if rid in self._running_by_id or rid in self.waiting:
            raise RequestRejected(f"request id {rid!r} is already in flight; use a unique id")
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.finish_reason = None
        request.stop_reason = None
        self.waiting.add(request)

    def abort_request(self, request_id: str) -> bool:
        """Abort in any state; its blocks are freed and its id is reported in the next
        schedule()'s finished_req_ids. False if no unfinished request has this id."""
        req = self._running_by_id.pop(request_id, None)
        if req is not None:
            self.running.remove(req)
        else:
            req = self.waiting.remove(request_id)
            if req is None:
                return False
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = FinishReason.ABORT
        self._finished_pending.add(request_id)
        self._worker_known.discard(request_id)
        self._num_aborted += 1
        return True

    def get_request(self, request_id: str) -> Request | None:
        req = self._running_by_id.get(request_id)
        return req if req is not None else self.waiting.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; only possible while no block is in use."""
        return self.kv.reset_prefix_cache()

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        step = _Step(step_id=self._num_steps, budget=cfg.max_num_batched_tokens)
        self._num_steps += 1
        if self.policy.aging and self.policy.refresh(time.monotonic()):
            self.waiting.reorder()

        self._schedule_running(step)
        if not step.preempted and self.waiting:
            self._schedule_waiting(step)

        total = cfg.max_num_batched_tokens - step.budget
        self._num_decode_tokens += step.num_decode
        self._num_prefill_tokens += total - step.num_decode
        out = SchedulerOutput(
            new_requests=step.new_reqs,
            cached_requests=step.cached_reqs,
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=total,
            preempted_req_ids=step.preempted,
            finished_req_ids=self._finished_pending,
            step_id=step.step_id,
        )
        self._finished_pending = set()
        self._last_out, self._last_reqs, self._last_ns = out, step.reqs, step.ns
        return out

    def _schedule_running(self, step: _Step) -> None:
        running = self.running
        threshold = self._threshold
        bs = self._block_size
        bs1 = bs - 1
        num_scheduled = step.num_scheduled
        cached_append = step.cached_reqs.append
        reqs_append, ns_append = step.reqs.append, step.ns.append
        budget = step.budget
        num_decode = 0
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            c = req.num_computed_tokens
            total = len(req.prompt_token_ids) + len(req.output_token_ids)
            n = total - c
            if n <= 0:  # nothing known left to compute (async placeholders, later)
                i += 1
                continue
            if threshold and n > threshold:
                n = threshold
            if n > budget:
                n = budget
            # a running request holds exactly ceil(c / bs) blocks: only a step that crosses a
            # block boundary needs the block pool at all
            if (c + n + bs1) // bs == (c + bs1) // bs:
                new_ids = []
            else:
                new_blocks = self.kv.allocate_slots(req, n)
                if new_blocks is None:
                    step.budget, step.num_decode = budget, num_decode
                    new_blocks, i = self._make_room(req, n, i, step)
                    budget, num_decode = step.budget, step.num_decode
                    if new_blocks is None:  # req itself was preempted; running[i] is the next
                        continue
                new_ids = [b.block_id for b in new_blocks]
            rid = req.request_id
            num_scheduled[rid] = n
            cached_append(CachedRequestData(rid, new_ids, c))
            reqs_append(req)
            ns_append(n)
            req.num_computed_tokens = c + n
            budget -= n
            if n == 1 and c + 1 == total and req.output_token_ids:
                num_decode += 1
            i += 1
        step.budget, step.num_decode = budget, num_decode

    def _make_room(
        self, req: Request, n: int, i: int, step: _Step
    ) -> tuple[Sequence[KVCacheBlock] | None, int]:
        """Preempt victims until ``req`` (at running[i]) gets its n slots. Returns its new
        blocks (None if it was preempted itself) and its index after the removals."""
        running = self.running
        while True:
            vi = self.policy.select_victim(running)
            victim = running.pop(vi)
            if vi < i:  # already scheduled this step: give its tokens and its output back
                i -= 1
                self._give_back(victim, step)
            self._preempt(victim, step)
            if victim is req:
                return None, i
            new_blocks = self.kv.allocate_slots(req, n)
            if new_blocks is not None:
                return new_blocks, i

    def _give_back(self, victim: Request, step: _Step) -> None:
        rid = victim.request_id
        n = step.num_scheduled.pop(rid, None)
        if n is None:
            return
        step.budget += n
        if n == 1 and victim.num_computed_tokens == victim.num_tokens and victim.output_token_ids:
            step.num_decode -= 1
        cached = step.cached_reqs
        for j in range(len(cached) - 1, -1, -1):
            if cached[j].request_id == rid:
                del cached[j]
                break
        for j in range(len(step.reqs) - 1, -1, -1):
            if step.reqs[j] is victim:
                del step.reqs[j]
                del step.ns[j]
                break

    def _preempt(self, victim: Request, step: _Step) -> None:
        """Recompute mode: free its blocks (full ones stay cached), reset progress, requeue at
        the head of waiting (keeping its arrival time and priority)."""
        self.kv.free(victim)
        del self._running_by_id[victim.request_id]
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self._num_preemptions += 1
        step.preempted.add(victim.request_id)
        self.waiting.prepend(victim)

    def _schedule_waiting(self, step: _Step) -> None:
        cfg = self.config
        waiting, running, kv = self.waiting, self.running, self.kv
        bs = self._block_size
        chunked = cfg.enable_chunked_prefill
        threshold = self._threshold
        max_seqs = cfg.max_num_seqs
        max_budget = cfg.max_num_batched_tokens
        max_skips = cfg.max_waiting_skips_per_step
        finished_pending = self._finished_pending
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
            hits = kv.find_cached_prefix(req)
            num_hit = len(hits) * bs
            total = req.num_tokens
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

    def _admit(self, req: Request, n: int, num_hit: int, total: int, step: _Step) -> None:
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
        req.num_computed_tokens = num_hit + n
        if n == 1 and num_hit + 1 == total and req.output_token_ids:
            step.num_decode += 1

    # ---- results ---------------------------------------------------------------------------
    def update_from_output(
        self, out: SchedulerOutput, sampled: Mapping[str, Sequence[int]]
    ) -> list[RequestOutput]:
        """Apply one step's sampled tokens (request id -> new token ids, [] for a partial
        prefill). Returns one RequestOutput per request that got tokens or finished. Outputs for
        requests aborted or preempted since ``out`` was made are ignored."""
        if out is self._last_out:
            pairs = zip(self._last_reqs, self._last_ns, strict=True)
        else:  # a copy (e.g. rebuilt from the wire): look the requests up by id
            get = self._running_by_id.get
            pairs = ((get(rid), n) for rid, n in out.num_scheduled_tokens.items())
        outputs: list[RequestOutput] = []
        append_output = outputs.append
        step_id = out.step_id
        bs = self._block_size
        caching = self._caching
        length_limit = self._length_limit
        any_finished = False
        for req, n in pairs:
            # skip requests aborted, finished or preempted (and maybe re-admitted) since
            if req is None or req.status is not _RUNNING or req.admitted_step > step_id:
                continue
            c = req.num_computed_tokens
            start = c - n
            hwm = req.max_computed_tokens
            if start < hwm:  # computed again after a preemption
                self._num_recomputed += (c if c < hwm else hwm) - start
            if c > hwm:
                req.max_computed_tokens = c
            if caching and c // bs != start // bs:  # the step filled a block: cache it
                self.kv.cache_full_blocks(req)
            out_ids = req.output_token_ids
            prompt_len = len(req.prompt_token_ids)
            if c < prompt_len + len(out_ids):
                continue  # partial prefill: whatever was sampled is meaningless
            rid = req.request_id
            tokens = sampled.get(rid)
            if not tokens:
                continue
            params = req.sampling_params
            if len(tokens) == 1:
                tok = tokens[0]
                out_ids.append(tok)
                num_out = len(out_ids)
                if (
                    num_out < params.max_tokens
                    and prompt_len + num_out < length_limit
                    and tok != req.eos_token_id
                    and not params.stop_token_ids
                ):  # fast path: none of the stop conditions can hold
                    append_output(RequestOutput(rid, [tok], None, None, num_out))
                    continue
                new_ids = [tok]
                stopped = check_stop(req, params, tok, length_limit)
            else:
                new_ids = []
                stopped = False
                for tok in tokens:
                    out_ids.append(tok)
                    new_ids.append(tok)
                    if check_stop(req, params, tok, length_limit):
                        stopped = True
                        break
            append_output(
                RequestOutput(rid, new_ids, req.finish_reason, req.stop_reason, len(out_ids))
            )
            if stopped:
                self._finish(req)
                any_finished = True
        if any_finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        return outputs

    def _finish(self, req: Request) -> None:
        rid = req.request_id
        req.status = RequestStatus.FINISHED
        self.kv.free(req)
        del self._running_by_id[rid]
        self._finished_pending.add(rid)
        self._worker_known.discard(rid)
        self._num_finished += 1

    # ---- introspection ---------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        pool = self.kv.pool
        queries = self._prefix_queries
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self._num_preemptions,
            kv_usage=pool.usage,
            prefix_cache_queries=queries,
            prefix_cache_hits=self._prefix_hits,
            num_recomputed_tokens=self._num_recomputed,
            num_free_blocks=pool.num_free_blocks,
            num_used_blocks=pool.num_used_blocks,
            num_total_blocks=pool.num_blocks,
            num_cached_blocks=len(pool.cached),
            num_steps=self._num_steps,
            num_prefill_tokens=self._num_prefill_tokens,
            num_decode_tokens=self._num_decode_tokens,
            num_scheduled_tokens=self._num_prefill_tokens + self._num_decode_tokens,
            num_finished=self._num_finished,
            num_aborted=self._num_aborted,
            prefix_cache_hit_rate=self._prefix_hits / queries if queries else 0.0,
        )
