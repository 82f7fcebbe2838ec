"""Admission checks: reject what can never run, with a sentence the user can act on."""

from __future__ import annotations

import math

from common.sampling_checks import (
    MAX_TOKEN_ID,
    check_token_ids,
    is_int,
    is_number,
    validate_sampling_params,
)
from scheduler_svc.core.errors import RequestRejected
from scheduler_svc.core.request import Request
from scheduler_svc.core.scheduler_config import SchedulerConfig

__all__ = ["MAX_TOKEN_ID", "validate_request", "validate_sampling_params"]


def validate_request(request: Request, config: SchedulerConfig) -> None:
    """Everything about one request that can be decided without the scheduler's state."""
    if not isinstance(request.request_id, str) or not request.request_id:
        raise RequestRejected("request_id must be a non-empty string")
    validate_sampling_params(request.sampling_params)
    prompt_len = len(request.prompt_token_ids)
    if prompt_len == 0:
        raise RequestRejected("the prompt is empty; send at least one token")
    check_token_ids("prompt token ids", request.prompt_token_ids)
    check_token_ids("output token ids", request.output_token_ids)
    prediction = request.sampling_params.prediction
    check_token_ids("prediction token ids", prediction)
    if request.eos_token_id is not None and (
        not is_int(request.eos_token_id) or request.eos_token_id < 0
    ):
        raise RequestRejected(f"eos_token_id must be an integer >= 0; got {request.eos_token_id!r}")
    if not is_int(request.priority):
        raise RequestRejected(f"priority must be an integer; got {request.priority!r}")
    if not is_number(request.arrival_time) or not math.isfinite(request.arrival_time):
        raise RequestRejected(f"arrival_time must be a finite number; got {request.arrival_time!r}")

    max_len = config.max_model_len
    if prompt_len >= max_len:
        # (a prompt of exactly max_model_len tokens leaves no room for a single output token)
        raise RequestRejected(
            f"prompt has {prompt_len} tokens but max_model_len is {max_len}; shorten the prompt"
        )
    if len(prediction) > max_len:  # drafts past max_model_len could never be verified
        raise RequestRejected(
            f"the prediction has {len(prediction)} tokens but max_model_len is {max_len}; "
            "shorten it"
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
