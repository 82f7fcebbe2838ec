"""Speculative decoding, the scheduler's half: drafting tokens from what it already holds.

The scheduler holds every request's prompt and output, so prompt-lookup (n-gram) drafting runs
where the tokens are: the last n tokens of a request are looked up among its earlier tokens, and
the tokens that followed the latest earlier occurrence are proposed. The drafts travel in the step
diff; the worker scores them in the same forward pass as the request's decode token and keeps the
prefix its own sampling agrees with (worker_svc/spec_decode.py).

    config = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 4,'
                                         ' "prompt_lookup_min": 2, "prompt_lookup_max": 4}')
    proposer = create_proposer(config)
    drafts = proposer.propose(request, max_tokens=4)   # [] when nothing matches

A proposer is one small interface (`Proposer`): a draft model on the worker or a suffix tree over
every request's outputs would be other implementations behind it. Drafting stays off where it
cannot pay: requests whose sampling needs what the worker only applies to single tokens
(penalties, logprobs, grammars), drafts past what the step's width pays for (draft_budget.py:
by the worker's measured step times, the step turns from reading the weights to arithmetic as
it widens), and requests whose drafts keep being rejected
(their acceptance, tracked per request, below `min_acceptance`) or whose lookups keep finding
nothing (MAX_MISSES in a row): those back off for BACK_OFF_STEPS steps, and a lookup that found
nothing skips one. While a request that drafts waits for its
latest token (its drafts must follow it), no running request is scheduled ahead: steps stay whole
batches, not two half batches taking turns, each reading every weight.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Protocol

from scheduler_svc.core.errors import SchedulerConfigError
from scheduler_svc.core.request import Request

METHODS = ("ngram",)
MAX_MISSES = 8  # lookups in a row without a match before a request backs off
BACK_OFF_STEPS = 4  # steps a backed-off request decodes one token at a time, pipelined
# without the worker's step times: the width past which a CPU step turned to arithmetic in
# docs/benchmarks.md's runs (a measuring worker replaces it with its own curve)
UNMEASURED_MAX_BATCH = 8


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 10  # most drafts per request per step
    prompt_lookup_min: int = 2  # shortest suffix looked up
    prompt_lookup_max: int = 4  # longest suffix looked up (tried first)
    # no drafting while more requests than this run; None: as many as the worker's measured
    # step times say pay (draft_budget.py), or UNMEASURED_MAX_BATCH where it measured none
    max_batch: int | None = None
    min_acceptance: float = 0.2  # a request's drafts back off below this acceptance rate

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SchedulerConfigError(
                f"unknown speculative method {self.method!r}; one of {', '.join(METHODS)}"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise SchedulerConfigError(
                f"num_speculative_tokens must be in [1, 16]; got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16:
            raise SchedulerConfigError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max <= 16; got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if (self.max_batch is not None and self.max_batch < 1) or not (
            0.0 <= self.min_acceptance < 1.0
        ):
            raise SchedulerConfigError("max_batch must be >= 1 and min_acceptance in [0, 1)")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """vLLM's --speculative-config form: a JSON object of the fields above."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SchedulerConfigError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise SchedulerConfigError("--speculative-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SchedulerConfigError(
                f"--speculative-config: unknown keys {unknown}; known: {sorted(known)}"
            )
        return cls(**raw)

    @classmethod
    def from_flag(cls, text: str) -> SpeculativeConfig | None:
        """--speculative-config as given: None (off) when empty."""
        return cls.from_json(text) if text.strip() else None


@dataclass(slots=True)
class SpecCounters:
    """What drafting and verification came to, for stats and metrics."""

    drafts: int = 0  # verifications (requests x steps with drafts)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # kept at draft position i
    draft_time_s: float = 0.0  # spent proposing, inside schedule()
    lookups: int = 0  # propose() calls

    def verified(self, num_drafted: int, num_accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += num_drafted
        self.accepted_tokens += num_accepted
        for i in range(num_accepted):  # drafts never exceed num_speculative_tokens positions
            self.accepted_per_pos[i] += 1


class Proposer(Protocol):
    def active(self, request: Request) -> bool:
        """Whether the request would draft at its next step (no side effects)."""
        ...

    def wants(self, request: Request) -> bool:
        """Whether to draft for this request now (asked once per step it decodes in; a request
        the proposer wants waits for its last token instead of being pipelined)."""
        ...

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Up to max_tokens draft tokens to follow the request's known tokens."""
        ...

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """What verification kept of the last drafts."""
        ...

    def forget(self, request_id: str) -> None: ...


class _NgramState:
    """One request's n-gram index: suffix -> end of its latest earlier occurrence."""

    __slots__ = ("drafted", "accepted", "tokens", "table", "skip", "misses")

    def __init__(self) -> None:
        self.table: dict[tuple[int, ...], int] = {}
        self.tokens: list[int] = []  # the request's tokens so far (indexed up to the last)
        self.drafted = 0.0  # decayed counts: acceptance follows what the text does now
        self.accepted = 0.0
        self.misses = 0  # lookups in a row that found nothing
        self.skip = 0  # steps left without drafting (backed off)


class NgramProposer:
    """Prompt lookup: the latest earlier occurrence of the longest matching suffix."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._states: dict[str, _NgramState] = {}

    def active(self, request: Request) -> bool:
        state = self._states.get(request.request_id)
        return state is None or not state.skip

    def wants(self, request: Request) -> bool:
        state = self._states.get(request.request_id)
        if state is None or not state.skip:
            return True
        state.skip -= 1
        return False

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        state = self._states.get(request.request_id)
        if state is None:
            state = self._states[request.request_id] = _NgramState()
        tokens, prompt = state.tokens, request.prompt_token_ids
        indexed = len(tokens)  # n-grams ending before this position are in the table
        if indexed < len(prompt):
            tokens.extend(prompt[indexed:])
        tokens.extend(request.output_token_ids[len(tokens) - len(prompt) :])
        length = len(tokens)
        lo, hi = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        table = state.table
        # index every n-gram that ends before the last token (one token must follow it)
        for end in range(max(indexed, lo), length):
            for n in range(lo, min(hi, end) + 1):
                table[tuple(tokens[end - n : end])] = end
        for n in range(min(hi, length - 1), lo - 1, -1):
            found = table.get(tuple(tokens[length - n :]))
            if found is not None:
                state.misses = 0
                return tokens[found : found + max_tokens]
        state.misses += 1
        # pipelined for the next step (no whole-batch wait on a request with nothing to draft);
        # after MAX_MISSES in a row, for a while
        state.skip = 1
        if state.misses >= MAX_MISSES:  # no repetition to draw on
            state.misses, state.skip = 0, BACK_OFF_STEPS
        return []

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        state = self._states.get(request.request_id)
        if state is None or not num_drafted:
            return
        state.drafted = 0.8 * state.drafted + num_drafted
        state.accepted = 0.8 * state.accepted + num_accepted
        if state.drafted >= 8 and state.accepted < self.config.min_acceptance * state.drafted:
            state.skip = BACK_OFF_STEPS  # try again later: the text may turn repetitive
            state.drafted = state.accepted = 0.0

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)


def create_proposer(config: SpeculativeConfig) -> Proposer:
    return NgramProposer(config)


def drafts_allowed(request: Request) -> bool:
    """Whether the worker can verify drafts for this request: its sampling applies per token
    without state the drafts would change (no penalties, logprobs, grammars, and past
    min_tokens, below which the worker holds EOS back)."""
    p = request.sampling_params
    return (
        p.logprobs is None
        and p.structured is None
        and not p.presence_penalty
        and not p.frequency_penalty
        and p.repetition_penalty == 1.0
        and p.min_tokens <= len(request.output_token_ids)
    )
