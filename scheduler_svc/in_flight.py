"""A request that a front-end process sent over its FrontendLink: the engine streams its tokens
as ids into the link's next TokenBatch instead of detokenizing them here (the front-end owns
detokenization, stop strings and the client's stream)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from common.convert import TokenLogprobs, sampling_from_proto
from common.pb import frontend_link_pb2 as pb
from scheduler_svc.core import FinishReason, validate_sampling_params
from scheduler_svc.request_state import RequestState


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
    ) -> None: ...


@dataclass(slots=True, eq=False)
class RemoteRequest(RequestState):
    sink: UpdateSink | None = None
    frontend_id: str = ""

    def push_tokens(
        self,
        token_ids: list[int],
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
        logprobs: list[TokenLogprobs] | None,
        now: float | None = None,
    ) -> bool:
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
        assert self.sink is not None
        self.sink.add_update(
            self.request_id,
            start,
            token_ids,
            finish_reason,
            "" if stop_reason is None else str(stop_reason),
            logprobs,
            worker_id=self.worker_id or "",
        )
        return False  # stop strings are the front-end's: it cancels the request

    def push_token(self, token_ids: list[int], now: float) -> bool:
        return self.push_tokens(token_ids, None, None, None, now)

    def fail(self, message: str, code: str = "") -> None:
        if self.finished:
            return
        self.finish_reason = FinishReason.ERROR
        assert self.sink is not None
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
        assert self.sink is not None
        self.sink.add_update(self.request_id, len(self.output_token_ids), [], FinishReason.ABORT)

    def set_stream_interval(self, interval: int) -> None:
        """Each step's tokens go out in one TokenBatch per front-end; the front-end paces."""


def remote_request(
    msg: pb.SubmitRequest, sink: UpdateSink, frontend_id: str, now: float | None = None
) -> RemoteRequest:
    """The engine's record of a submitted (or, after a takeover, resubmitted) request.
    Raises RequestRejected on sampling parameters the core refuses (never trust the wire)."""
    params, _ = sampling_from_proto(msg.sampling)
    validate_sampling_params(params)
    now = time.monotonic() if now is None else now
    return RemoteRequest(
        request_id=msg.request_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        params=params,
        detokenizer=None,  # type: ignore[arg-type]
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
        sink=sink,
        frontend_id=frontend_id,
    )
