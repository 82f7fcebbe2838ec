"""A request as the scheduler core sees it: token ids in, token ids out, one progress counter."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from common.messages import SamplingParams
from common.outcomes import FinishReason

__all__ = ["FinishReason", "Request", "RequestStatus"]


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    SWAPPED = enum.auto()
    FINISHED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self is RequestStatus.FINISHED


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower value = more important
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_id: int | None = None
    tenant: str | None = None
    deadline: float | None = None  # absolute time.monotonic() deadline, policy hint
    ttft_deadline: float | None = None  # absolute time its first token is due (a TTFT target)
    tpot_target_s: float | None = None  # mean seconds between its output tokens, at most
    # tokens generated before this scheduler saw the request (migration from a lost worker)
    output_token_ids: list[int] = field(default_factory=list)
    lora_name: str = ""  # the LoRA adapter it runs with; "" = the base model

    # progress, owned by the scheduler
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first schedule; -1 = not yet scheduled
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    missed_target: str | None = None  # shed: the target it could no longer meet (its client hears)
    # scheduler bookkeeping (added with the scheduler core; callers leave these alone)
    max_computed_tokens: int = 0  # high-water mark of computed tokens (recompute accounting)
    admitted_step: int = -1  # step in which it was last admitted (stale-output detection)
    lora_skipped_steps: int = 0  # steps skipped since its last admission: no adapter slot free
    # tokens scheduled to be sampled whose values have not come back yet (async scheduling:
    # step N+1 is scheduled before step N returns; the worker knows its own sampled tokens)
    num_output_placeholders: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache hashes, full blocks
    block_hashes_block_size: int = 0  # the block size block_hashes were computed for

    def __post_init__(self) -> None:
        if self.arrival_time is None:  # passed explicitly: stamped now, as by default
            self.arrival_time = time.monotonic()
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.output_token_ids = list(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens known: prompt + output. num_computed_tokens chases this."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def is_finished(self) -> bool:
        return self.status.is_finished

    def mark_shed(self, missed_target: str) -> None:
        """Ended by the policy: it can no longer meet `missed_target`."""
        self.status = RequestStatus.FINISHED
        self.finish_reason = FinishReason.SHED
        self.missed_target = missed_target
