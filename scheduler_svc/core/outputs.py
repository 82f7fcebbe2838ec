"""What one schedule() step produces (a diff for the worker) and what update_from_output returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler_svc.core.request import FinishReason, SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the worker has not seen (or must rebuild): travels once."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit: tokens whose KV is already in block_ids
    # tokens generated before (migration or re-send); appended after the prompt
    output_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class CachedRequestData:
    """A request the worker already holds."""

    request_id: str
    new_block_ids: list[int]  # appended blocks; the full block table when resumed
    num_computed_tokens: int
    resumed: bool = False
    # for a resumed request: every output token so far (the worker replaces its copy);
    # empty otherwise (the worker already knows the tokens it sampled; one shared empty tuple,
    # not a new list per running request per step)
    new_token_ids: Sequence[int] = ()


@dataclass(slots=True)
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)  # finished/aborted since last step
    # swap: (device_block, host_block) pairs to copy out before / in before the forward
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    step_id: int = 0

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


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
