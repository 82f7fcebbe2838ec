"""The Scheduler: one per worker. Each step decides which requests compute how many tokens.

One progress model: a request's ``num_computed_tokens`` chases its ``num_tokens`` (prompt +
output; "tokens known"), so prefill, chunked prefill, prefix-cache hits and decode are the same
loop. ``num_computed_tokens`` is advanced in schedule(), right when the step is decided (as vLLM
V1 does), and blocks the step fills are registered in the prefix cache then; update_from_output()
appends the sampled tokens, checks stop conditions and finishes requests.

A step: running requests first (in admission order), each gets min(remaining, budget) tokens; if
its KV blocks cannot be allocated, victims chosen by the policy are preempted (recompute: blocks
freed, progress reset, back to the head of waiting; swap: computed KV copied to host blocks,
progress kept, into the swapped queue) until it fits or it is the victim itself; a victim already
scheduled this step gives its tokens back. Then, unless something was preempted, swapped requests
resume and waiting requests are admitted in policy order while budget, max_num_seqs and blocks
(keeping the watermark free) allow (admission.py). The result is a SchedulerOutput diff for the
worker; update_from_output() is in output_processing.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from time import perf_counter

from common.messages import CachedRequestData, NewRequestData, SchedulerOutput
from scheduler_svc.core.admission import AdmissionMixin
from scheduler_svc.core.adoption import AdoptionMixin
from scheduler_svc.core.block_pool import KVCacheBlock
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.draft_budget import DraftBudget
from scheduler_svc.core.errors import RequestRejected, SchedulerConfigError
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.output_processing import OutputProcessorMixin
from scheduler_svc.core.policy import create_policy
from scheduler_svc.core.preemption_cost import PreemptionCostModel
from scheduler_svc.core.request import FinishReason, Request, RequestStatus
from scheduler_svc.core.request_queue import RequestQueue, create_request_queue
from scheduler_svc.core.speculative import (
    UNMEASURED_MAX_BATCH,
    Proposer,
    SpecCounters,
    create_proposer,
    drafts_allowed,
)
from scheduler_svc.core.stats import SchedulerStats
from scheduler_svc.core.step_state import StepState
from scheduler_svc.core.validation import validate_request

_RUNNING = RequestStatus.RUNNING
MAX_STEPS_IN_FLIGHT = 8


class Scheduler(AdmissionMixin, AdoptionMixin, OutputProcessorMixin):
    def __init__(self, config: SchedulerConfig, waiting_queue: RequestQueue | None = None):
        self.config = config
        if waiting_queue is None:
            self.policy = create_policy(config.policy, **config.policy_options)
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
        self.kv = KVCacheManager(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.num_host_blocks,
        )
        # swapped-out requests (their KV in host blocks): this worker's own queue, resumed
        # before any waiting request is admitted
        self.swapped: RequestQueue = create_request_queue(self.policy)
        self._preemption_mode = config.preemption_mode
        self._cost = PreemptionCostModel(
            self.kv, config.preemption_mode, config.worker_costs, config.auto_swap_min_tokens
        )
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
        self._adopted_unsent: set[str] = set()  # adopted, running, not yet sent (adoption.py)
        self._finished_pending: set[str] = set()  # finished/aborted, reported by next schedule()
        # per step not yet applied (async scheduling keeps two in flight): its scheduled
        # requests, token counts and whether each samples; update_from_output() walks these
        self._inflight: dict[int, tuple[list[Request], list[int], list[bool]]] = {}
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
        self._num_swap_outs = 0
        self._num_swap_ins = 0
        self._num_shed = 0
        self._shed: list[Request] = []  # ended by _shed_hopeless, not yet taken by take_shed()
        # speculative decoding (speculative.py): drafts per in-flight step, and their counts
        spec = config.speculative
        self._proposer = create_proposer(spec) if spec is not None else None
        self._max_drafts = spec.num_speculative_tokens if spec is not None else 0
        self._spec_max_batch = spec.max_batch if spec is not None else None
        costs = config.worker_costs
        # sized by the worker's measured step times (draft_budget.py) where it measured them
        self._draft_budget = (
            DraftBudget(costs.verify_step_s)
            if spec is not None and costs is not None and costs.verify_step_s
            else None
        )
        if spec is not None and self._draft_budget is None and self._spec_max_batch is None:
            self._spec_max_batch = UNMEASURED_MAX_BATCH
        self._spec_inflight: dict[int, dict[str, int]] = {}  # step -> request -> drafts sent
        self._spec_counts = SpecCounters(accepted_per_pos=[0] * self._max_drafts)

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises RequestRejected (with a sentence) if it can never run."""
        validate_request(request, self.config)
        rid = request.request_id
        if rid in self._running_by_id or rid in self.waiting or rid in self.swapped:
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
            self.kv.free(req)
            self._adopted_unsent.discard(request_id)
        elif (req := self.swapped.remove(request_id)) is not None:
            self.kv.free_host(req)
        elif (req := self.waiting.remove(request_id)) is None:
            return False
        req.status = RequestStatus.FINISHED
        req.finish_reason = FinishReason.ABORT
        if self._proposer is not None:
            self._proposer.forget(request_id)
        self._finished_pending.add(request_id)
        self._worker_known.discard(request_id)
        self._num_aborted += 1
        return True

    def take_shed(self) -> list[Request]:
        """Requests ended with FinishReason.SHED since the last call (their clients must hear)."""
        shed, self._shed = self._shed, []
        return shed

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished request (running, swapped or waiting) by id."""
        req = self._running_by_id.get(request_id)
        if req is None:
            req = self.swapped.get(request_id)
        return req if req is not None else self.waiting.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.swapped) or bool(self.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.swapped) + len(self.waiting)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; only possible while no block is in use."""
        return self.kv.reset_prefix_cache()

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        step = StepState(step_id=self._num_steps, budget=cfg.max_num_batched_tokens)
        self._num_steps += 1
        if self.policy.aging and self.policy.refresh(self.policy.clock()):
            self.waiting.reorder()
        self._shed_hopeless()
        self._unseat_hopeless(step)

        self._schedule_running(step)
        if not step.preempted:  # no admission in a step that preempted
            if self.swapped:
                self._schedule_swapped(step)
            # swapped requests resume first, unless the policy holds the first one back
            if self.waiting and (not self.swapped or not self._swapped_head_admitted()):
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
            blocks_to_swap_out=step.swap_out,
            blocks_to_swap_in=step.swap_in,
            step_id=step.step_id,
            spec_token_ids=step.spec,
        )
        if step.spec:
            self._spec_inflight[step.step_id] = {r: len(d) for r, d in step.spec.items()}
            if len(self._spec_inflight) > MAX_STEPS_IN_FLIGHT:
                del self._spec_inflight[min(self._spec_inflight)]
        self._finished_pending = set()
        if self.policy.accounts and step.reqs:  # per-tenant service (fair share)
            self.policy.account(step.reqs, step.ns)
        if step.reqs:
            inflight = self._inflight
            inflight[step.step_id] = (step.reqs, step.ns, step.samples)
            if len(inflight) > MAX_STEPS_IN_FLIGHT:  # outputs that never came back
                del inflight[min(inflight)]
        return out

    def _shed_hopeless(self) -> None:
        """End the waiting requests the policy calls hopeless (they cannot meet their targets
        any more) at once, as an abort would, with FinishReason.SHED."""
        for req in self.policy.hopeless_waiting():
            rid = req.request_id
            if self.waiting.remove(rid) is None:
                continue  # not in a queue this scheduler can take it from
            self._end_shed(req)

    def _end_shed(self, req: Request) -> None:
        rid = req.request_id
        req.mark_shed(self.policy.missed_target(req))
        self._finished_pending.add(rid)
        self._worker_known.discard(rid)
        self._num_shed += 1
        self._shed.append(req)

    def _unseat_hopeless(self, step: StepState) -> None:
        """A request that can still meet its targets waits at the head of the queue without a
        seat (max_num_seqs, the policy's gate or blocks) while running requests cannot meet
        theirs: they give up their seats, most expendable first, until it has one. Preempted
        as blocks running short would (recompute or swap), so the policy's order puts them
        behind the feasible requests and aging bounds their wait; with ``shed_hopeless`` ended
        instead, as they would be at the next step's shedding anyway."""
        policy = self.policy
        head = self.waiting.peek()
        if head is None or not policy.wants_seat(head) or self._has_seat(head):
            return
        for victim in policy.hopeless_running(self.running):
            self.running.remove(victim)
            if policy.shed_hopeless:
                del self._running_by_id[victim.request_id]
                self._adopted_unsent.discard(victim.request_id)
                self.kv.free(victim)
                self._end_shed(victim)
            else:
                self._preempt(victim, step)
            if self._has_seat(head):
                return

    def _has_seat(self, head: Request) -> bool:
        """Admission would find a seat, the policy's consent and the blocks of its first step
        for this waiting request (prefix-cache hits not counted: a seat too few is the safe
        error, it only unseats a request that can no longer count)."""
        if len(self.running) >= self.config.max_num_seqs or not self.policy.admits(head):
            return False
        if self.swapped and self._swapped_head_admitted():
            return False  # the swapped request resumes first
        n = min(head.num_tokens, self.config.max_num_batched_tokens)
        if self._threshold:
            n = min(n, self._threshold)
        need = -(-n // self._block_size)
        reserve = self._watermark_blocks if self.running else 0
        return need + reserve <= self.kv.num_free_blocks

    def _swapped_head_admitted(self) -> bool:
        head = self.swapped.peek()
        return head is not None and self.policy.admits(head)

    def _schedule_running(self, step: StepState) -> None:
        running = self.running
        threshold = self._threshold
        caching = self._caching
        bs = self._block_size
        bs1 = bs - 1
        num_scheduled = step.num_scheduled
        cached_append = step.cached_reqs.append
        reqs_append, ns_append = step.reqs.append, step.ns.append
        samples_append = step.samples.append
        length_limit = self._length_limit
        adopted = self._adopted_unsent
        budget = step.budget
        num_decode = 0
        proposer = self._proposer
        drafts_left = self._drafts_for_step(len(running)) if proposer is not None else 0
        if not drafts_left:
            proposer = None  # a large batch is bound by arithmetic: drafts would cost
        if proposer is not None and self._awaiting_drafter(proposer):
            return  # one whole batch once its tokens are back, not half batches taking turns
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            c = req.num_computed_tokens
            num_out = len(req.output_token_ids)
            ph = req.num_output_placeholders
            total = len(req.prompt_token_ids) + num_out + ph
            n = total - c
            if n <= 0 or (
                ph and (num_out + ph >= req.sampling_params.max_tokens or total >= length_limit)
            ):  # nothing left to compute, or its last token is already on its way
                i += 1
                continue
            drafts = None
            # (with its last token on its way, _awaiting_drafter returned before the loop)
            if proposer is not None and n == 1 and drafts_allowed(req) and proposer.wants(req):
                room = min(
                    self._max_drafts,
                    drafts_left,
                    budget - 1,
                    req.sampling_params.max_tokens - num_out - 1,
                    length_limit - total - 1,
                )
                if room > 0:
                    drafting = perf_counter()
                    drafts = proposer.propose(req, room) or None
                    self._spec_counts.draft_time_s += perf_counter() - drafting
                    self._spec_counts.lookups += 1
                    if drafts is not None:
                        n += len(drafts)
                        drafts_left -= len(drafts)
            if threshold and n > threshold:
                n = threshold
            if n > budget:
                n = budget
            # a running request holds exactly ceil(c / bs) blocks: only a step that crosses a
            # block boundary needs the block pool at all
            if (c + n + bs1) // bs == (c + bs1) // bs:
                new_ids = []
                if caching and (c + n) // bs != c // bs:  # this step fills a block
                    self.kv.cache_full_blocks(req, c + n)
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
            if drafts is not None:
                step.spec[rid] = drafts
            if adopted and rid in adopted:
                self._send_adopted(req, c, step)
            else:
                cached_append(CachedRequestData(rid, new_ids, c))
            reqs_append(req)
            ns_append(n)
            if c < req.max_computed_tokens:  # computed before a preemption: recomputed
                self._note_computed(req, c, n)
            else:  # new ground (n > 0): _note_computed's other case, without the call
                req.max_computed_tokens = c + n
            req.num_computed_tokens = c + n
            samples = c + n == total or drafts is not None
            if samples:
                req.num_output_placeholders = ph + 1
            samples_append(samples)
            budget -= n
            if n == 1 and c + 1 == total and req.output_token_ids:
                num_decode += 1
            i += 1
        step.budget, step.num_decode = budget, num_decode

    def _send_adopted(self, req: Request, c: int, step: StepState) -> None:
        """An adopted request's first step: the worker forgot its row, so it travels as new with
        its whole block table, its KV held up to c (as after a prefix-cache hit)."""
        rid = req.request_id
        self._adopted_unsent.discard(rid)
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

    def _make_room(
        self, req: Request, n: int, i: int, step: StepState
    ) -> tuple[Sequence[KVCacheBlock] | None, int]:
        """Preempt victims until ``req`` (at running[i]) gets its n slots. Returns its new
        blocks (None if it was preempted itself) and its index after the removals."""
        running = self.running
        while True:
            # DESIGN's rule (the least important, latest arrival) unless preemption is
            # cost-based ("auto"): then equally important candidates are ranked by wasted work
            waste = self._cost.waste if self._preemption_mode == "auto" else None
            vi = self.policy.select_victim(running, waste)
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

    def _give_back(self, victim: Request, step: StepState) -> None:
        rid = victim.request_id
        n = step.num_scheduled.pop(rid, None)
        if n is None:
            return
        step.budget += n
        if n == 1 and victim.num_computed_tokens == victim.num_tokens and victim.output_token_ids:
            step.num_decode -= 1
        victim.num_computed_tokens -= n  # those tokens will not be computed in this step
        step.spec.pop(rid, None)
        self.kv.uncache_uncomputed(victim)  # nor will the blocks they would have filled
        cached = step.cached_reqs
        for j in range(len(cached) - 1, -1, -1):
            if cached[j].request_id == rid:
                del cached[j]
                break
        else:  # an adopted request's first step (_send_adopted): the worker will not hear of it
            new = step.new_reqs
            for j in range(len(new) - 1, -1, -1):
                if new[j].request_id == rid:
                    del new[j]
                    self._worker_known.discard(rid)
                    break
        for j in range(len(step.reqs) - 1, -1, -1):
            if step.reqs[j] is victim:
                if step.samples[j]:
                    victim.num_output_placeholders -= 1
                del step.reqs[j]
                del step.ns[j]
                del step.samples[j]
                break

    def _preempt(self, victim: Request, step: StepState) -> None:
        """Swap (its computed KV to host blocks, progress kept, into the swapped queue) when the
        mode says so and the host has room; otherwise recompute: free its blocks (full ones stay
        cached), reset progress, requeue at the head of waiting (keeping arrival and priority)."""
        rid = victim.request_id
        del self._running_by_id[rid]
        self._adopted_unsent.discard(rid)  # unsent, it now returns the way any request does
        victim.num_preemptions += 1
        self._num_preemptions += 1
        step.preempted.add(rid)
        if (
            self._preemption_mode != "recompute"
            and not self._drafts_in_flight(rid)  # its computed count includes unverified drafts
            and self._cost.prefers_swap(victim)
        ):
            pairs = self.kv.swap_out(victim)
            if pairs is not None:
                victim.status = RequestStatus.SWAPPED
                step.swap_out += pairs
                self._num_swap_outs += 1
                self.swapped.prepend(victim)
                return
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        self.waiting.prepend(victim)

    def _drafts_for_step(self, rows: int) -> int:
        """The most drafted tokens this step takes with `rows` running requests."""
        cap = self._spec_max_batch
        if cap is not None and rows > cap:
            return 0
        most = rows * self._max_drafts
        return most if self._draft_budget is None else self._draft_budget.best(rows, most)

    def note_worker_wait(self, step: SchedulerOutput, idle_s: float) -> None:
        """The worker's idle time before `step` (its reply says): before a step with drafts it
        is what verifying costs beyond the forward pass (the batch waited for its tokens)."""
        if step.spec_token_ids and self._draft_budget is not None:
            self._draft_budget.waited(idle_s)

    def _awaiting_drafter(self, proposer: Proposer) -> bool:
        """A running request that will draft has its last token still on its way."""
        return any(
            r.num_output_placeholders and drafts_allowed(r) and proposer.active(r)
            for r in self.running
        )

    def _drafts_in_flight(self, request_id: str) -> bool:
        return any(request_id in drafts for drafts in self._spec_inflight.values())

    def _note_computed(self, req: Request, c: int, n: int) -> None:
        """Recompute accounting when tokens [c, c + n) are scheduled: those below the request's
        high-water mark are computed again (after a preemption)."""
        hwm = req.max_computed_tokens
        if c < hwm:
            self._num_recomputed += min(c + n, hwm) - c
        if c + n > hwm:
            req.max_computed_tokens = c + n

    # ---- introspection ---------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        pool = self.kv.pool
        queries = self._prefix_queries
        spec = self._spec_counts
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
            num_shed=self._num_shed,
            num_swapped=len(self.swapped),
            num_swap_outs=self._num_swap_outs,
            num_swap_ins=self._num_swap_ins,
            num_free_host_blocks=self.kv.host_pool.num_free_blocks,
            num_total_host_blocks=self.kv.host_pool.num_blocks,
            prefix_cache_hit_rate=self._prefix_hits / queries if queries else 0.0,
            num_spec_drafts=spec.drafts,
            num_spec_draft_tokens=spec.draft_tokens,
            num_spec_accepted_tokens=spec.accepted_tokens,
            spec_accepted_per_pos=list(spec.accepted_per_pos),
            spec_draft_time_s=spec.draft_time_s,
            num_spec_lookups=spec.lookups,
        )
