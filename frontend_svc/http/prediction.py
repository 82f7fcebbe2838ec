"""Predicted Outputs in a response's usage: OpenAI's `completion_tokens_details`
`accepted_prediction_tokens` (the prediction's tokens that appear in the completion, in order)
and `rejected_prediction_tokens` (the rest of the prediction). The scheduler drafts from the
prediction (docs/speculative.md); these counts compare the prediction with the output, as
OpenAI defines them, not the drafts the worker kept (those are the spec_decode metrics)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from difflib import SequenceMatcher

from frontend_svc.client_request import ClientRequest


def prediction_counts(prediction: Sequence[int], output: Sequence[int]) -> tuple[int, int]:
    """(accepted, rejected): the prediction's tokens matched in the output, the others."""
    if not prediction:
        return 0, 0
    blocks = SequenceMatcher(None, prediction, output, autojunk=False).get_matching_blocks()
    accepted = sum(block.size for block in blocks)
    return accepted, len(prediction) - accepted


def _details(states: Sequence[ClientRequest]) -> dict | None:
    accepted = rejected = 0
    predicted = False
    for state in states:
        if state.params.prediction:
            predicted = True
            a, r = prediction_counts(state.params.prediction, state.output_token_ids)
            accepted, rejected = accepted + a, rejected + r
    if not predicted:
        return None
    return {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": rejected}


async def add_prediction_usage(usage: dict | None, states: Sequence[ClientRequest]) -> None:
    """Add the counts to `usage` when a request carried a prediction (the comparison runs on a
    thread: it may take a while for long outputs)."""
    if usage is None or not any(s.params.prediction for s in states):
        return
    details = await asyncio.to_thread(_details, states)
    if details is not None:
        usage.setdefault("completion_tokens_details", {}).update(details)
