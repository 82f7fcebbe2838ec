"""Admission checks: reject what can never run, with a sentence the user can act on."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeGuard

from common.messages import SamplingParams
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.errors import RequestRejected
from scheduler_svc.core.request import Request

MAX_TOKEN_ID = 2**63 - 1  # token ids are hashed as int64


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _finite(name: str, value: object, hint: str) -> float:
    if not _is_number(value):
        raise RequestRejected(f"{name} must be a number ({hint}); got {value!r}")
    if not math.isfinite(value):
        raise RequestRejected(f"{name} must be a finite number ({hint}); got {value!r}")
    return float(value)


def validate_sampling_params(params: SamplingParams) -> None:
    """Raise RequestRejected (a ValueError) when a sampling value is out of range."""
    if not _is_int(params.max_tokens) or params.max_tokens < 1:
        raise RequestRejected(f"max_tokens must be an integer >= 1; got {params.max_tokens!r}")
    if not _is_int(params.min_tokens) or params.min_tokens < 0:
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
    if not _is_int(params.top_k) or params.top_k < 0:
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
    if params.seed is not None and not _is_int(params.seed):
        raise RequestRejected(f"seed must be an integer or unset; got {params.seed!r}")
    if params.logprobs is not None and (not _is_int(params.logprobs) or params.logprobs < 0):
        raise RequestRejected(
            f"logprobs must be an integer >= 0 (or unset to turn it off); got {params.logprobs!r}"
        )
    _check_token_ids("stop_token_ids", params.stop_token_ids)


def _check_token_ids(what: str, ids: Sequence[int]) -> None:
    if not ids:
        return
    for tok in ids:
        if not _is_int(tok):
            raise RequestRejected(f"{what} must be integers; got {tok!r}")
    lo, hi = min(ids), max(ids)
    if lo < 0:
        raise RequestRejected(f"{what} contain a negative token id ({lo}); token ids are >= 0")
    if hi > MAX_TOKEN_ID:
        raise RequestRejected(f"{what} contain an impossibly large token id ({hi})")


def validate_request(request: Request, config: SchedulerConfig) -> None:
    """Everything about one request that can be decided without the scheduler's state."""
    if not isinstance(request.request_id, str) or not request.request_id:
        raise RequestRejected("request_id must be a non-empty string")
    validate_sampling_params(request.sampling_params)
    prompt_len = len(request.prompt_token_ids)
    if prompt_len == 0:
        raise RequestRejected("the prompt is empty; send at least one token")
    _check_token_ids("prompt token ids", request.prompt_token_ids)
    _check_token_ids("output token ids", request.output_token_ids)
    if request.eos_token_id is not None and (
        not _is_int(request.eos_token_id) or request.eos_token_id < 0
    ):
        raise RequestRejected(f"eos_token_id must be an integer >= 0; got {request.eos_token_id!r}")
    if not _is_int(request.priority):
        raise RequestRejected(f"priority must be an integer; got {request.priority!r}")
    if not _is_number(request.arrival_time) or not math.isfinite(request.arrival_time):
        raise RequestRejected(f"arrival_time must be a finite number; got {request.arrival_time!r}")

    max_len = config.max_model_len
    if prompt_len >= max_len:
        # (a prompt of exactly max_model_len tokens leaves no room for a single output token)
        raise RequestRejected(
            f"prompt has {prompt_len} tokens but max_model_len is {max_len}; shorten the prompt"
        )
    num_out = len(request.output_token_ids)
    num_tokens = prompt_len + num_out
    if num_out:
        if num_tokens >= max_len:
            raise RequestRejected(
                f"prompt ({prompt_len} tokens) and earlier output ({num_out} tokens) already "
                f"reach max_model_len {max_len}; nothing is left to generate"
            )
        if num_out >= request.sampling_params.max_tokens:
            raise RequestRejected(
                f"the request already has {num_out} output tokens and max_tokens is "
                f"{request.sampling_params.max_tokens}; nothing is left to generate"
            )
    budget = config.max_num_batched_tokens
    if not config.enable_chunked_prefill and prompt_len > budget:
        raise RequestRejected(
            f"prompt has {prompt_len} tokens but one step computes at most {budget} "
            f"(max_num_batched_tokens) and chunked prefill is off; shorten the prompt or enable "
            f"chunked prefill"
        )
    bs = config.block_size
    need = -(-num_tokens // bs)
    if need > config.num_blocks:
        what = "prompt" if not num_out else "prompt and earlier output"
        raise RequestRejected(
            f"{what} of {num_tokens} tokens needs {need} KV blocks of {bs} tokens but the pool "
            f"has only {config.num_blocks} ({config.kv_capacity_tokens} tokens); shorten the "
            f"prompt"
        )
