"""Applying a step's sampled tokens: progress bookkeeping, stop checks, finishing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from scheduler_svc.core.outputs import RequestOutput, SchedulerOutput
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.stopping import check_stop

if TYPE_CHECKING:
    from scheduler_svc.core.kv_cache_manager import KVCacheManager

_RUNNING = RequestStatus.RUNNING


class OutputProcessorMixin:
    """Part of Scheduler (kept in its own file): update_from_output()."""

    kv: KVCacheManager
    running: list[Request]
    _running_by_id: dict[str, Request]
    _worker_known: set[str]
    _finished_pending: set[str]
    _length_limit: int
    _last_out: SchedulerOutput | None
    _last_reqs: list[Request]
    _last_ns: list[int]
    _num_recomputed: int
    _num_finished: int

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
