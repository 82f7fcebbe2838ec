"""What a chat body adds to the chat template's variables, beside the messages and the tools:
`add_generation_prompt` and `continue_final_message` (vLLM's), `reasoning_effort` and
`verbosity` (OpenAI's), and vLLM's `chat_template_kwargs`, any further variables. A template
that does not read a variable renders the same without it (SmolLM2's reads none of them)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from frontend_svc.http.errors import OpenAIError

# what the server sets (and the template's own functions): chat_template_kwargs cannot replace
SERVER_VARIABLES = frozenset(
    {
        "messages",
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        "raise_exception",
        "strftime_now",
    }
)
BODY_VARIABLES = ("reasoning_effort", "verbosity")  # top-level fields, passed when set


def template_variables(
    body: Any,
    messages: list[dict[str, Any]],
    special_tokens: Iterable[str],
    add_generation_prompt: bool | None = None,
) -> dict[str, Any]:
    """The variables to render `messages` with; `add_generation_prompt`: the caller's choice
    (the /tokenize route's), else the body's. `special_tokens`: the names the tokenizer sets
    (bos_token, eos_token...), which chat_template_kwargs cannot replace either."""
    continue_final = bool(getattr(body, "continue_final_message", False))
    if add_generation_prompt is None:
        add_generation_prompt = _generation_prompt(body, continue_final)
    if continue_final:
        _check_continuable(messages, add_generation_prompt)
    variables = _extra_variables(body, frozenset(special_tokens))
    variables["add_generation_prompt"] = add_generation_prompt
    if continue_final:
        variables["continue_final_message"] = True
    return variables


def _generation_prompt(body: Any, continue_final: bool) -> bool:
    """The body's add_generation_prompt (default true); left out next to
    continue_final_message, false: the model goes on with the last message instead."""
    asked = "add_generation_prompt" in (getattr(body, "model_fields_set", None) or ())
    if continue_final and not asked:
        return False
    return bool(getattr(body, "add_generation_prompt", True))


def _check_continuable(messages: list[dict[str, Any]], add_generation_prompt: bool) -> None:
    if add_generation_prompt:
        raise OpenAIError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true: the model "
            "either continues the last message or starts a new one; send "
            "add_generation_prompt: false",
            "continue_final_message",
        )
    last = messages[-1] if messages else {}
    if last.get("role") != "assistant" or not last.get("content"):
        raise OpenAIError(
            400,
            "continue_final_message needs the last message to be an assistant message with "
            "content, the text the model goes on with",
            "continue_final_message",
        )


def _extra_variables(body: Any, special_tokens: frozenset[str]) -> dict[str, Any]:
    """chat_template_kwargs, with reasoning_effort and verbosity where the body sets them."""
    kwargs = dict(getattr(body, "chat_template_kwargs", None) or {})
    for key in kwargs:
        if key in SERVER_VARIABLES or key in special_tokens:
            raise OpenAIError(
                400,
                f"chat_template_kwargs cannot set {key!r}: the server sets that variable "
                "(messages, tools and add_generation_prompt come from their own fields)",
                f"chat_template_kwargs.{key}",
            )
    for name in BODY_VARIABLES:
        value = getattr(body, name, None)
        if value is None:
            continue
        if name in kwargs and kwargs[name] != value:
            raise OpenAIError(
                400,
                f"{name} is {value!r} but chat_template_kwargs.{name} is {kwargs[name]!r}; "
                "send one",
                name,
            )
        kwargs[name] = value
    return kwargs
