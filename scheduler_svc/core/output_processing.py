"""Applying a step's sampled tokens: progress bookkeeping, stop checks, finishing."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from common.messages import SchedulerOutput
from scheduler_svc.core.draft_tracking import DraftTracker
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.outputs import RequestOutput
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.request_queue import RequestQueue
from scheduler_svc.core.stats import SchedulerCounters
from scheduler_svc.core.step_state import MAX_STEPS_IN_FLIGHT, StepState
from scheduler_svc.core.stopping import check_stop
from scheduler_svc.core.worker_view import WorkerView

_RUNNING = RequestStatus.RUNNING
_FINISHED = RequestStatus.FINISHED


class OutputProcessor:
    def __init__(
        self,
        *,
        kv: KVCacheManager,
        running: list[Request],
        running_by_id: dict[str, Request],
        waiting: RequestQueue,
        swapped: RequestQueue,
        worker_view: WorkerView,
        drafts: DraftTracker,
        counters: SchedulerCounters,
        length_limit: int,
    ) -> None:
        self.kv = kv
        self.running = running
        self.running_by_id = running_by_id
        self.waiting = waiting
        self.swapped = swapped
        self.worker_view = worker_view
        self.drafts = drafts
        self.counters = counters
        self.length_limit = length_limit
        # per step not yet applied: its scheduled requests, token counts and whether each
        # samples; update_from_output() walks these
        self.in_flight: dict[int, tuple[list[Request], list[int], list[bool]]] = {}

    def expect(self, step: StepState) -> None:
        """The outputs of this step will come back."""
        in_flight = self.in_flight
        in_flight[step.step_id] = (step.reqs, step.ns, step.samples)
        if len(in_flight) > MAX_STEPS_IN_FLIGHT:  # outputs that never came back
            del in_flight[min(in_flight)]

    def update_from_output(
        self, out: SchedulerOutput, sampled: Mapping[str, Sequence[int]]
    ) -> list[RequestOutput]:
        """Apply one step's sampled tokens (request id -> new token ids, [] for a partial
        prefill). Returns one RequestOutput per request that got tokens or finished.

        Steps may be applied after later ones were scheduled (async scheduling): a request
        preempted since keeps the token it sampled (it is valid output); outputs for requests
        aborted or finished since, or re-admitted after the step, are dropped."""
        record = self.in_flight.pop(out.step_id, None)
        triples: Iterable[tuple[Request | None, int, bool]]  # (request, tokens, sampled?)
        if record is not None:
            triples = zip(*record, strict=True)
        else:  # not a step of ours (e.g. rebuilt from the wire): look running requests up
            get = self.running_by_id.get
            triples = (
                (get(rid), n, bool(sampled.get(rid))) for rid, n in out.num_scheduled_tokens.items()
            )
        drafted = self.drafts.take_step(out.step_id)
        if drafted:
            self._apply_verification(drafted, sampled, out.step_id)
        outputs: list[RequestOutput] = []
        append_output = outputs.append
        step_id = out.step_id
        length_limit = self.length_limit
        any_finished = False
        for req, _n, samples in triples:
            if req is None or not samples:
                continue  # partial prefill: whatever was sampled is meaningless
            if record is not None and req.num_output_placeholders > 0:
                req.num_output_placeholders -= 1
            status = req.status
            if status is _FINISHED or req.admitted_step > step_id:
                continue
            rid = req.request_id
            tokens = sampled.get(rid)
            if not tokens:
                continue
            out_ids = req.output_token_ids
            prompt_len = len(req.prompt_token_ids)
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
                if status is _RUNNING:
                    self._finish(req)
                    any_finished = True
                else:  # preempted since this step: it ends from the queue it waits in
                    self._finish_queued(req)
        if any_finished:
            running = self.running  # shared with the scheduler: filtered in place
            running[:] = [r for r in running if r.status is _RUNNING]
        return outputs

    def _apply_verification(
        self, drafted: dict[str, int], sampled: Mapping[str, Sequence[int]], step_id: int
    ) -> None:
        """A step's verified drafts: a request that got a + 1 tokens for k drafts keeps a of
        them; its computed count and blocks lose the k - a rejected positions (their KV is
        garbage), before its tokens are appended."""
        for rid, k in drafted.items():
            req = self.running_by_id.get(rid)
            tokens = sampled.get(rid)
            if req is None or not tokens or req.admitted_step > step_id:
                continue  # finished, aborted or preempted since (its progress restarted)
            accepted = min(len(tokens) - 1, k)
            req.num_computed_tokens -= k - accepted
            # the rejected positions were never valid KV: computing them again is not recompute
            req.max_computed_tokens = min(req.max_computed_tokens, req.num_computed_tokens)
            self.kv.trim(req)
            self.drafts.verified(req, k, accepted)

    def _finish_queued(self, req: Request) -> None:
        rid = req.request_id
        if self.swapped.remove(rid) is not None:
            self.kv.free_host(req)
        else:
            self.waiting.remove(rid)
        req.status = RequestStatus.FINISHED
        self._ended(rid)

    def _finish(self, req: Request) -> None:
        rid = req.request_id
        req.status = RequestStatus.FINISHED
        self.kv.free(req)
        del self.running_by_id[rid]
        self._ended(rid)

    def _ended(self, rid: str) -> None:
        self.worker_view.end(rid)
        self.counters.num_finished += 1
        self.drafts.forget(rid)
