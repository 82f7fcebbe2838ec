"""Stop conditions checked after each sampled token is appended."""

from __future__ import annotations

from common.messages import SamplingParams
from scheduler_svc.core.request import FinishReason, Request


def check_stop(request: Request, params: SamplingParams, token: int, length_limit: int) -> bool:
    """Set the request's finish reason and return True when ``token`` (just appended) ends it.

    Order (as vLLM V1): length first (max_tokens outputs, or ``length_limit`` tokens in all),
    then nothing before min_tokens outputs, then EOS (unless ignore_eos), then stop_token_ids.
    stop_reason is the token id that stopped it.
    """
    num_out = len(request.output_token_ids)
    if num_out >= params.max_tokens or len(request.prompt_token_ids) + num_out >= length_limit:
        request.finish_reason = FinishReason.LENGTH
        return True
    if num_out < params.min_tokens:
        return False
    if token == request.eos_token_id and not params.ignore_eos:
        request.finish_reason = FinishReason.STOP
        request.stop_reason = token
        return True
    stop_ids = params.stop_token_ids
    if stop_ids and token in stop_ids:
        request.finish_reason = FinishReason.STOP
        request.stop_reason = token
        return True
    return False
