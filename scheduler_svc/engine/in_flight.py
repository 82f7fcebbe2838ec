"""The scheduler's record of a request in flight: the core request, what it has generated, and
where its updates go (its front-end's sink). Text, stop strings and client streams are the
front-end's (frontend_svc/): the scheduler sends token ids and finish reasons, nothing else.

A sink is a FrontendSession (a front-end process over the FrontendLink) or the in-process
front-end of the embedded mode (splitserve/embedded.py); the engine cannot tell them apart.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Protocol

from common.convert import TokenLogprobs, sampling_from_proto, sampling_to_proto
from common.messages import SamplingParams
from common.outcomes import FinishReason
from common.pb import frontend_link_pb2 as pb
from scheduler_svc.core import Request, validate_sampling_params


class UpdateSink(Protocol):
    def add_update(
        self,
        request_id: str,
        start: int,
        token_ids: list[int],
        finish_reason: FinishReason | None = None,
        stop_reason: str = "",
        logprobs: list[TokenLogprobs] | None = None,
        error: str = "",
        error_code: str = "",
        worker_id: str = "",
    ) -> bool:
        """One request's news; `start` is the index of its first token in the output. Returns
        True when the front-end ended the request there (a stop string): the scheduler frees
        it as stopped. A sink that learns of stop strings later returns False and cancels."""
        ...

    def add_next_token(self, request_id: str, start: int, token_id: int) -> bool:
        """add_update of the usual news: one more token, the request goes on, on the worker
        the sink was last told of."""
        ...


@dataclass(slots=True, eq=False)
class InFlightRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: UpdateSink
    frontend_id: str = ""  # "" for the front-end inside this process
    priority: int = 0
    tenant: str | None = None
    deadline: float | None = None
    ttft_target_s: float | None = None  # seconds from arrival to the first token, at most
    tpot_target_s: float | None = None  # mean seconds between output tokens, at most
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    worker_id: str | None = None
    num_migrations: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: FinishReason | None = None
    wait_timer: asyncio.TimerHandle | None = None
    core: Request | None = None  # the core request, in the global queue or on a worker
    inflight_hashes: list[bytes] = field(default_factory=list)  # prefix announced to a worker
    announced_worker: str = ""  # the worker its sink was last told of
    # n > 1: a sibling waits for this request's prompt to be computed (and cached), then
    # prefills only the partial last block (the engine parks it)
    prefill_after: str | None = None
    lora_name: str = ""  # the LoRA adapter it runs with; "" = the base model

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_core_request(self) -> Request:
        """A core Request carrying everything generated so far (for a first or a new worker)."""
        return Request(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=self.params,
            priority=self.priority,
            arrival_time=self.arrival_time,
            eos_token_id=self.eos_token_id,
            tenant=self.tenant,
            deadline=self.deadline,
            ttft_deadline=(
                None if self.ttft_target_s is None else self.arrival_time + self.ttft_target_s
            ),
            tpot_target_s=self.tpot_target_s,
            output_token_ids=list(self.output_token_ids),
            lora_name=self.lora_name,
        )

    def push_tokens(
        self,
        token_ids: list[int],
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
        logprobs: list[TokenLogprobs] | None,
        now: float | None = None,
    ) -> bool:
        """Record tokens and send them on. Returns True when the front-end ended the request
        with a stop string (it is then finished, as stopped)."""
        if self.finish_reason is not None:
            return False
        start = len(self.output_token_ids)
        if token_ids:
            now = time.monotonic() if now is None else now
            if self.first_token_time is None:
                self.first_token_time = now
            self.last_token_time = now
            self.output_token_ids.extend(token_ids)
        elif finish_reason is None:
            return False
        if finish_reason is not None:
            self.finish_reason = finish_reason
        self.announced_worker = self.worker_id or ""
        stopped = self.sink.add_update(
            self.request_id,
            start,
            token_ids,
            finish_reason,
            "" if stop_reason is None else str(stop_reason),
            logprobs,
            worker_id=self.announced_worker,
        )
        if stopped and self.finish_reason is None:
            self.finish_reason = FinishReason.STOP
        return stopped

    def push_token(self, token_ids: list[int], now: float) -> bool:
        """push_tokens for the step loop's usual case: one token, the request goes on."""
        if self.finish_reason is not None:
            return False
        output_token_ids = self.output_token_ids
        start = len(output_token_ids)
        output_token_ids.append(token_ids[0])
        self.last_token_time = now
        if self.first_token_time is None:
            self.first_token_time = now
        worker_id = self.worker_id or ""
        if worker_id == self.announced_worker:
            stopped = self.sink.add_next_token(self.request_id, start, token_ids[0])
        else:
            self.announced_worker = worker_id
            stopped = self.sink.add_update(self.request_id, start, token_ids, worker_id=worker_id)
        if stopped:
            self.finish_reason = FinishReason.STOP
            return True
        return False

    def fail(self, message: str, code: str = "") -> None:
        if self.finished:
            return
        self.finish_reason = FinishReason.ERROR
        self.sink.add_update(
            self.request_id,
            len(self.output_token_ids),
            [],
            FinishReason.ERROR,
            error=message,
            error_code=code,
        )

    def end_aborted(self) -> None:
        if self.finished:
            return
        self.finish_reason = FinishReason.ABORT
        self.sink.add_update(self.request_id, len(self.output_token_ids), [], FinishReason.ABORT)


def from_submit(
    msg: pb.SubmitRequest, sink: UpdateSink, frontend_id: str, now: float | None = None
) -> InFlightRequest:
    """The engine's record of a submitted (or, after a takeover, resubmitted) request.
    Raises RequestRejected on sampling parameters the core refuses (never trust the wire)."""
    params, _ = sampling_from_proto(msg.sampling)
    validate_sampling_params(params)
    now = time.monotonic() if now is None else now
    return InFlightRequest(
        request_id=msg.request_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        params=params,
        sink=sink,
        frontend_id=frontend_id,
        priority=msg.priority,
        tenant=msg.tenant or None,
        deadline=now + msg.deadline_left_s if msg.deadline_left_s > 0 else None,
        eos_token_id=None if msg.eos_token_id < 0 else msg.eos_token_id,
        arrival_time=now - max(0.0, msg.age_s),
        output_token_ids=list(msg.output_token_ids),
        num_migrations=msg.num_migrations,
        first_token_time=now if msg.output_token_ids else None,
        prefill_after=msg.prefill_after or None,
        ttft_target_s=msg.ttft_target_s if msg.ttft_target_s > 0 else None,
        tpot_target_s=msg.tpot_target_s if msg.tpot_target_s > 0 else None,
        lora_name=msg.lora_name,
    )


def to_submit(state: InFlightRequest, now: float | None = None) -> pb.SubmitRequest:
    """from_submit's inverse: the request as a step shard gets it (or gives it back, with the
    output its client has)."""
    now = time.monotonic() if now is None else now
    return pb.SubmitRequest(
        request_id=state.request_id,
        prompt_token_ids=state.prompt_token_ids,
        sampling=sampling_to_proto(state.params),
        priority=state.priority,
        tenant=state.tenant or "",
        deadline_left_s=0.0 if state.deadline is None else max(1e-3, state.deadline - now),
        output_token_ids=state.output_token_ids,
        num_migrations=state.num_migrations,
        age_s=max(0.0, now - state.arrival_time),
        eos_token_id=-1 if state.eos_token_id is None else state.eos_token_id,
        prefill_after=state.prefill_after or "",
        ttft_target_s=state.ttft_target_s or 0.0,
        tpot_target_s=state.tpot_target_s or 0.0,
        lora_name=state.lora_name,
    )
