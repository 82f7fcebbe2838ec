"""The Scheduler: one per worker. Each step decides which requests compute how many tokens.

One progress model: a request's ``num_computed_tokens`` chases its ``num_tokens`` (prompt +
output; "tokens known"), so prefill, chunked prefill, prefix-cache hits and decode are the same
loop. ``num_computed_tokens`` is advanced in schedule(), right when the step is decided (as vLLM
V1 does), and blocks the step fills are registered in the prefix cache then; update_from_output()
appends the sampled tokens, checks stop conditions and finishes requests.

A step: running requests first (in admission order), each gets min(remaining, budget) tokens; if
its KV blocks cannot be allocated, victims chosen by the policy are preempted (preemption.py)
until it fits or it is the victim itself. Then, unless something was preempted, swapped requests
resume and waiting requests are admitted in policy order while budget, max_num_seqs and blocks
(keeping the watermark free) allow (waiting_admission.py). The result is a SchedulerOutput diff
for the worker (worker_view.py tracks what the worker holds). update_from_output() is in
output_processing.py, adopt_request() in adoption.py, speculative drafts in draft_tracking.py.
The Scheduler owns the queues, the running list and the KV cache manager; its helpers hold
references to the parts they change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from common.messages import CachedRequestData, SchedulerOutput
from scheduler_svc.core.adoption import Adopter
from scheduler_svc.core.draft_tracking import DraftTracker
from scheduler_svc.core.errors import RequestRejected, SchedulerConfigError
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.lora_slots import AdapterBook, check_adapter
from scheduler_svc.core.output_processing import OutputProcessor
from scheduler_svc.core.outputs import RequestOutput
from scheduler_svc.core.policy import create_policy
from scheduler_svc.core.preemption import Preemptor
from scheduler_svc.core.preemption_cost import PreemptionCostModel
from scheduler_svc.core.request import FinishReason, Request, RequestStatus
from scheduler_svc.core.request_queue import RequestQueue, create_request_queue
from scheduler_svc.core.scheduler_config import SchedulerConfig
from scheduler_svc.core.shedding import Shedder
from scheduler_svc.core.speculative import Proposer, drafts_allowed
from scheduler_svc.core.stats import SchedulerCounters, SchedulerStats, collect_stats
from scheduler_svc.core.step_state import StepState
from scheduler_svc.core.validation import validate_request
from scheduler_svc.core.waiting_admission import WaitingAdmitter
from scheduler_svc.core.worker_view import WorkerView


class Scheduler:
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
        # admission order; one list shared with the helpers, so changed in place only
        self.running: list[Request] = []
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
        self._block_size = config.block_size
        self._caching = config.enable_prefix_caching
        self._threshold = (
            config.long_prefill_token_threshold if config.enable_chunked_prefill else 0
        )
        # a request ends with LENGTH when its tokens reach max_model_len, or when computing its
        # next token would need more KV than the whole pool holds (it could never run alone)
        self._length_limit = min(config.max_model_len, config.kv_capacity_tokens + 1)
        self._counters = SchedulerCounters()
        self._adapters = AdapterBook()  # requests with a LoRA adapter, for stats()
        self._worker_view = WorkerView()
        self._draft_tracker = DraftTracker(config.speculative, config.worker_costs)
        self._cost = PreemptionCostModel(
            self.kv, config.preemption_mode, config.worker_costs, config.auto_swap_min_tokens
        )
        self._preemptor = Preemptor(
            policy=self.policy,
            cost=self._cost,
            kv=self.kv,
            running=self.running,
            running_by_id=self._running_by_id,
            waiting=self.waiting,
            swapped=self.swapped,
            worker_view=self._worker_view,
            drafts=self._draft_tracker,
            counters=self._counters,
        )
        self._admitter = WaitingAdmitter(
            config=config,
            kv=self.kv,
            running=self.running,
            running_by_id=self._running_by_id,
            waiting=self.waiting,
            swapped=self.swapped,
            worker_view=self._worker_view,
            counters=self._counters,
            adapters=self._adapters,
        )
        self._shedder = Shedder(
            policy=self.policy,
            kv=self.kv,
            running=self.running,
            running_by_id=self._running_by_id,
            waiting=self.waiting,
            worker_view=self._worker_view,
            counters=self._counters,
            preemptor=self._preemptor,
            admitter=self._admitter,
        )
        self._adopter = Adopter(
            config=config,
            kv=self.kv,
            running=self.running,
            running_by_id=self._running_by_id,
            waiting=self.waiting,
            swapped=self.swapped,
            worker_view=self._worker_view,
        )
        self._outputs = OutputProcessor(
            kv=self.kv,
            running=self.running,
            running_by_id=self._running_by_id,
            waiting=self.waiting,
            swapped=self.swapped,
            worker_view=self._worker_view,
            drafts=self._draft_tracker,
            counters=self._counters,
            length_limit=self._length_limit,
        )

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises RequestRejected (with a sentence) if it can never run."""
        validate_request(request, self.config)
        check_adapter(request, self.config.max_loras)
        rid = request.request_id
        if rid in self._running_by_id or rid in self.waiting or rid in self.swapped:
            raise RequestRejected(f"request id {rid!r} is already in flight; use a unique id")
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.finish_reason = None
        request.stop_reason = None
        self.waiting.add(request)
        self._adapters.note(request, self.get_num_unfinished_requests())

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
        check_adapter(request, self.config.max_loras)
        self._adopter.adopt(request, block_ids, num_computed_tokens, self._counters.num_steps)
        self._adapters.note(request, self.get_num_unfinished_requests())

    def abort_request(self, request_id: str) -> bool:
        """Abort in any state; its blocks are freed and its id is reported in the next
        schedule()'s finished_req_ids. False if no unfinished request has this id."""
        req = self._running_by_id.pop(request_id, None)
        if req is not None:
            self.running.remove(req)
            self.kv.free(req)
            self._worker_view.adopted_unsent.discard(request_id)
        elif (req := self.swapped.remove(request_id)) is not None:
            self.kv.free_host(req)
        elif (req := self.waiting.remove(request_id)) is None:
            return False
        req.status = RequestStatus.FINISHED
        req.finish_reason = FinishReason.ABORT
        self._draft_tracker.forget(request_id)
        self._worker_view.end(request_id)
        self._counters.num_aborted += 1
        return True

    def take_shed(self) -> list[Request]:
        """Requests ended with FinishReason.SHED since the last call (their clients must hear)."""
        shed = self._shedder.take_shed()
        for req in shed:
            self._draft_tracker.forget(req.request_id)
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
        counters = self._counters
        step = StepState(step_id=counters.num_steps, budget=cfg.max_num_batched_tokens)
        counters.num_steps += 1
        if self.policy.aging and self.policy.refresh(self.policy.clock()):
            self.waiting.reorder()
        self._shedder.shed_waiting()
        self._shedder.unseat_running(step)

        self._schedule_running(step)
        if not step.preempted:  # no admission in a step that preempted
            admitter = self._admitter
            if self.swapped:
                admitter.resume_swapped(step)
            # swapped requests resume first, unless the policy holds the first one back
            if self.waiting and (not self.swapped or not admitter.swapped_head_admitted()):
                admitter.admit_waiting(step)

        total = cfg.max_num_batched_tokens - step.budget
        counters.num_decode_tokens += step.num_decode
        counters.num_prefill_tokens += total - step.num_decode
        out = SchedulerOutput(
            new_requests=step.new_reqs,
            cached_requests=step.cached_reqs,
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=total,
            preempted_req_ids=step.preempted,
            finished_req_ids=self._worker_view.take_finished(),
            blocks_to_swap_out=step.swap_out,
            blocks_to_swap_in=step.swap_in,
            step_id=step.step_id,
            spec_token_ids=step.spec,
        )
        if step.spec:
            self._draft_tracker.sent(step.step_id, step.spec)
        if step.new_reqs:  # those with a prediction draft from their next step
            self._draft_tracker.admitted(step.new_reqs)
        if step.reqs:
            if self.policy.accounts:  # per-tenant service (fair share)
                self.policy.account(step.reqs, step.ns)
            self._outputs.expect(step)
        return out

    def update_from_output(
        self, out: SchedulerOutput, sampled: Mapping[str, Sequence[int]]
    ) -> list[RequestOutput]:
        """Apply one step's sampled tokens (request id -> new token ids, [] for a partial
        prefill). Returns one RequestOutput per request that got tokens or finished.

        Steps may be applied after later ones were scheduled (async scheduling): a request
        preempted since keeps the token it sampled (it is valid output); outputs for requests
        aborted or finished since, or re-admitted after the step, are dropped."""
        return self._outputs.update_from_output(out, sampled)

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
        worker_view = self._worker_view
        adopted = worker_view.adopted_unsent
        tracker = self._draft_tracker
        budget = step.budget
        num_decode = 0
        proposer = tracker.proposer
        drafts_left = tracker.for_step(len(running)) if proposer is not None else 0
        if not drafts_left:
            proposer = None  # a large batch is bound by arithmetic: drafts would cost
        if proposer is not None and tracker.awaiting_latest_token(proposer, running):
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
            # (with its last token on its way, awaiting_latest_token returned before the loop)
            if proposer is not None and n == 1 and drafts_allowed(req) and proposer.wants(req):
                room = min(
                    tracker.max_drafts,
                    drafts_left,
                    budget - 1,
                    req.sampling_params.max_tokens - num_out - 1,
                    length_limit - total - 1,
                )
                if room > 0:
                    drafts = tracker.propose(proposer, req, room)
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
                    new_blocks, i = self._preemptor.make_room(req, n, i, step)
                    budget, num_decode = step.budget, step.num_decode
                    if new_blocks is None:  # req itself was preempted; running[i] is the next
                        continue
                new_ids = [b.block_id for b in new_blocks]
            rid = req.request_id
            num_scheduled[rid] = n
            if drafts is not None:
                step.spec[rid] = drafts
            if adopted and rid in adopted:  # its first step since adoption: sent as new
                adopted.discard(rid)
                worker_view.send(req, self.kv.block_ids(rid), c, step)
            else:
                cached_append(CachedRequestData(rid, new_ids, c))
            reqs_append(req)
            ns_append(n)
            if c < req.max_computed_tokens:  # computed before a preemption: recomputed
                self._counters.count_computed(req, c, n)
            else:  # new ground (n > 0): count_computed's other case, without the call
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

    def note_worker_wait(self, step: SchedulerOutput, idle_s: float) -> None:
        """The worker's idle time before `step` (its reply says): before a step with drafts it
        is what verifying costs beyond the forward pass (the batch waited for its tokens)."""
        self._draft_tracker.worker_waited(step, idle_s)

    # ---- introspection ---------------------------------------------------------------------
    @property
    def _proposer(self) -> Proposer | None:
        return self._draft_tracker.proposer

    @_proposer.setter
    def _proposer(self, proposer: Proposer | None) -> None:  # tests and benches draft their way
        self._draft_tracker.proposer = proposer

    @property
    def _worker_known(self) -> set[str]:
        return self._worker_view.known

    def stats(self) -> SchedulerStats:
        return collect_stats(
            self._counters,
            self._draft_tracker.counts,
            self.kv,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=len(self.swapped),
            loras=self._adapters.counts(self._running_by_id, self.waiting, self.swapped),
        )
