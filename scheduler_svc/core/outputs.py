"""What update_from_output() returns, per request. The diff that one schedule() step produces for
the worker (SchedulerOutput and its parts) crosses the split: it lives in common/messages.py."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.core.request import FinishReason


@dataclass(slots=True)
class RequestOutput:
    """Per request, what one update_from_output() added."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_output_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
