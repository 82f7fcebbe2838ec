"""The plain dataclasses that cross the split: how to sample a request (SamplingParams) and
what one scheduler step tells a worker (SchedulerOutput and its parts).

The scheduler core builds them, the worker reads them, common/convert.py maps them to and from
protobuf; neither side imports the other to get them. scheduler_svc.core re-exports them under
the names its API has always had.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class StructuredOutput:
    """A constraint on what may be generated (common/structured.py compiles it).

    kind: json_schema (spec: the schema as JSON text), json_object (any JSON object; spec ""),
    regex (spec: the pattern), choice (spec: a JSON list of strings), grammar (spec: a Lark or
    GBNF grammar), any_of (spec: a JSON list of options, one of which the output matches;
    common/structured.py's `any_of` builds it)."""

    kind: str
    spec: str = ""


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per sampled token; None = off
    structured: StructuredOutput | None = None  # the output must match it
    # Predicted Outputs: the expected output's token ids, drafted by the scheduler
    # (scheduler_svc/core/prediction.py); never sent to a worker
    prediction: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
    lora_name: str = ""  # the LoRA adapter the request runs with; "" = the base model


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
    # speculative decoding: draft tokens to score after a request's next token; its
    # num_scheduled_tokens counts them (1 + len(drafts))
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
