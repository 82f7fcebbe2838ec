"""Applying a step's sampled tokens: progress bookkeeping, stop checks, finishing."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from common.messages import SchedulerOutput
from scheduler_svc.core.outputs import RequestOutput
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.stopping import check_stop

if TYPE_CHECKING:
    from scheduler_svc.core.draft_budget import DraftBudget
    from scheduler_svc.core.kv_cache_manager import KVCacheManager
    from scheduler_svc.core.request_queue import RequestQueue
    from scheduler_svc.core.speculative import Proposer, SpecCounters

_RUNNING = RequestStatus.RUNNING
_FINISHED = RequestStatus.FINISHED


class OutputProcessorMixin:
    """Part of Scheduler (kept in its own file): update_from_output()."""

    kv: KVCacheManager
    running: list[Request]
    _running_by_id: dict[str, Request]
    _worker_known: set[str]
    _finished_pending: set[str]
    _length_limit: int
    _inflight: dict[int, tuple[list[Request], list[int], list[bool]]]
    waiting: RequestQueue
    swapped: RequestQueue
    _num_finished: int
    _proposer: Proposer | None
    _spec_inflight: dict[int, dict[str, int]]
    _spec_counts: SpecCounters
    _draft_budget: DraftBudget | None

    def update_from_output(
        self, out: SchedulerOutput, sampled: Mapping[str, Sequence[int]]
    ) -> list[RequestOutput]:
        """Apply one step's sampled tokens (request id -> new token ids, [] for a partial
        prefill). Returns one RequestOutput per request that got tokens or finished.

        Steps may be applied after later ones were scheduled (async scheduling): a request
        preempted since keeps the token it sampled (it is valid output); outputs for requests
        aborted or finished since, or re-admitted after the step, are dropped."""
        record = self._inflight.pop(out.step_id, None)
        triples: Iterable[tuple[Request | None, int, bool]]  # (request, tokens, sampled?)
        if record is not None:
            triples = zip(*record, strict=True)
        else:  # not a step of ours (e.g. rebuilt from the wire): look running requests up
            get = self._running_by_id.get
            triples = (
                (get(rid), n, bool(sampled.get(rid))) for rid, n in out.num_scheduled_tokens.items()
            )
        drafted = self._spec_inflight.pop(out.step_id, None) if self._spec_inflight else None
        if drafted:
            self._verified(drafted, sampled, out.step_id)
        outputs: list[RequestOutput] = []
        append_output = outputs.append
        step_id = out.step_id
        length_limit = self._length_limit
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
            self.running = [r for r in self.running if r.status is _RUNNING]
        return outputs

    def _verified(
        self, drafted: dict[str, int], sampled: Mapping[str, Sequence[int]], step_id: int
    ) -> None:
        """A step's verified drafts: a request that got a + 1 tokens for k drafts keeps a of
        them; its computed count and blocks lose the k - a rejected positions (their KV is
        garbage), before its tokens are appended."""
        for rid, k in drafted.items():
            req = self._running_by_id.get(rid)
            tokens = sampled.get(rid)
            if req is None or not tokens or req.admitted_step > step_id:
                continue  # finished, aborted or preempted since (its progress restarted)
            accepted = min(len(tokens) - 1, k)
            req.num_computed_tokens -= k - accepted
            # the rejected positions were never valid KV: computing them again is not recompute
            req.max_computed_tokens = min(req.max_computed_tokens, req.num_computed_tokens)
            self.kv.trim(req)
            self._spec_counts.verified(k, accepted)
            if self._draft_budget is not None:
                self._draft_budget.verified(k, accepted)
            if self._proposer is not None:
                self._proposer.record(req, k, accepted)

    def _finish_queued(self, req: Request) -> None:
        rid = req.request_id
        if self.swapped.remove(rid) is not None:
            self.kv.free_host(req)
        else:
            self.waiting.remove(rid)
        req.status = RequestStatus.FINISHED
        self._finished_pending.add(rid)
        self._worker_known.discard(rid)
        self._num_finished += 1
        if self._proposer is not None:
            self._proposer.forget(rid)

    def _finish(self, req: Request) -> None:
        rid = req.request_id
        req.status = RequestStatus.FINISHED
        self.kv.free(req)
        del self._running_by_id[rid]
        self._finished_pending.add(rid)
        self._worker_known.discard(rid)
        self._num_finished += 1
        if self._proposer is not None:
            self._proposer.forget(rid)
