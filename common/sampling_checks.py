"""Checks of what a request asks for that need no scheduler: sampling parameters and token
ids. Front-ends run them before anything is sent; the scheduler core runs them again on what
arrives (never trust the wire)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeGuard

from common.messages import SamplingParams
from common.outcomes import RequestRejected

MAX_TOKEN_ID = 2**63 - 1  # token ids are hashed as int64


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _finite(name: str, value: object, hint: str) -> float:
    if not is_number(value):
        raise RequestRejected(f"{name} must be a number ({hint}); got {value!r}")
    if not math.isfinite(value):
        raise RequestRejected(f"{name} must be a finite number ({hint}); got {value!r}")
    return float(value)


def validate_sampling_params(params: SamplingParams) -> None:
    """Raise RequestRejected (a ValueError) when a sampling value is out of range."""
    if not is_int(params.max_tokens) or params.max_tokens < 1:
        raise RequestRejected(f"max_tokens must be an integer >= 1; got {params.max_tokens!r}")
    if not is_int(params.min_tokens) or params.min_tokens < 0:
        raise RequestRejected(f"min_tokens must be an integer >= 0; got {params.min_tokens!r}")
    if params.min_tokens > params.max_tokens:
        raise RequestRejected(
            f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({params.max_tokens})"
        )
    t = _finite("temperature", params.temperature, "0 for greedy, or > 0")
    if t < 0:
        raise RequestRejected(f"temperature must be >= 0 (0 means greedy); got {t!r}")
    p = _finite("top_p", params.top_p, "in (0, 1]")
    if not 0.0 < p <= 1.0:
        raise RequestRejected(f"top_p must be in (0, 1] (1 disables it); got {p!r}")
    if not is_int(params.top_k) or params.top_k < 0:
        raise RequestRejected(
            f"top_k must be an integer >= 0 (0 disables it); got {params.top_k!r}"
        )
    m = _finite("min_p", params.min_p, "in [0, 1]")
    if not 0.0 <= m <= 1.0:
        raise RequestRejected(f"min_p must be in [0, 1] (0 disables it); got {m!r}")
    r = _finite("repetition_penalty", params.repetition_penalty, "> 0, 1 disables it")
    if r <= 0:
        raise RequestRejected(f"repetition_penalty must be > 0 (1 disables it); got {r!r}")
    _finite("presence_penalty", params.presence_penalty, "0 disables it")
    _finite("frequency_penalty", params.frequency_penalty, "0 disables it")
    if params.seed is not None and not is_int(params.seed):
        raise RequestRejected(f"seed must be an integer or unset; got {params.seed!r}")
    if params.logprobs is not None and (not is_int(params.logprobs) or params.logprobs < 0):
        raise RequestRejected(
            f"logprobs must be an integer >= 0 (or unset to turn it off); got {params.logprobs!r}"
        )
    check_token_ids("stop_token_ids", params.stop_token_ids)


def check_token_ids(what: str, ids: Sequence[int]) -> None:
    if not ids:
        return
    for tok in ids:
        if not is_int(tok):
            raise RequestRejected(f"{what} must be integers; got {tok!r}")
    lo, hi = min(ids), max(ids)
    if lo < 0:
        raise RequestRejected(f"{what} contain a negative token id ({lo}); token ids are >= 0")
    if hi > MAX_TOKEN_ID:
        raise RequestRejected(f"{what} contain an impossibly large token id ({hi})")
