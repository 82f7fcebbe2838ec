"""The prompts of a /v1/completions body: a string, a list of token ids, or a list of either.
Each prompt gets a request of its own (and n choices), as OpenAI and vLLM answer a list."""

from __future__ import annotations

from typing import Any

from frontend_svc.http.errors import OpenAIError
from frontend_svc.intake import FieldRejected, Intake

# the requests one body may make: prompts × max(n, best_of) (n alone is at most MAX_CHOICES)
MAX_COMPLETIONS = 64


def completion_prompts(intake: Intake, prompt: Any, per_prompt: int) -> list[list[int]]:
    """Each prompt's token ids; `per_prompt`: the requests each one makes (n or best_of).
    A refusal of one prompt of several names it (`prompt.1`)."""
    listed = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
    items = list(prompt) if listed else [prompt]
    several = len(items) > 1
    total = len(items) * per_prompt
    if total > MAX_COMPLETIONS:
        raise OpenAIError(
            400,
            f"{len(items)} prompts × {per_prompt} choices = {total} completions; at most "
            f"{MAX_COMPLETIONS} per request (send the prompts in several requests)",
            "prompt",
        )
    out = []
    for i, item in enumerate(items):
        if not item:
            where = f"prompt[{i}]" if several else "the prompt"
            raise OpenAIError(400, f"{where} is empty", f"prompt.{i}" if several else "prompt")
        try:
            out.append(_token_ids(intake, item))
        except FieldRejected as exc:
            if not several:
                raise
            raise FieldRejected(f"prompt.{i}", str(exc)) from exc
    return out


def _token_ids(intake: Intake, item: str | list[int]) -> list[int]:
    if isinstance(item, str):
        return intake.encode_prompt(item)
    return intake.check_token_ids(list(item))
