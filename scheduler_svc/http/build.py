"""OpenAI request bodies -> validated RequestStates (through the same Intake as gRPC)."""

from __future__ import annotations

import math
import uuid
from dataclasses import replace

from common.messages import StructuredOutput
from scheduler_svc.core import RequestRejected, SamplingParams, validate_sampling_params
from scheduler_svc.http.constraints import constraint
from scheduler_svc.http.errors import OpenAIError
from scheduler_svc.http.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    _SamplingBody,
)
from scheduler_svc.http.tool_prompt import template_inputs
from scheduler_svc.http.tools import ToolPlan, tool_constraint, tool_plan
from scheduler_svc.intake import (
    MAX_CHOICES,
    MAX_REQUEST_ID_LEN,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    Intake,
)
from scheduler_svc.request_state import RequestState

MAX_LOGPROBS = 20
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def check_model(intake: Intake, model: str | None) -> None:
    """404 for a model this server does not serve (None or "" means the served one)."""
    try:
        intake.check_model(model or "")
    except RequestRejected as exc:
        raise OpenAIError(404, str(exc), "model", "model_not_found") from exc


def _common_checks(body: _SamplingBody) -> None:
    if not 1 <= body.n <= MAX_CHOICES:
        raise OpenAIError(400, f"n must be in [1, {MAX_CHOICES}]; got {body.n}", "n")
    if body.logit_bias:
        raise OpenAIError(
            400,
            "logit_bias is not supported; to restrict the tokens use guided_choice, guided_regex "
            "or structured_outputs",
            "logit_bias",
        )
    if body.stream_options is not None and not body.stream:
        raise OpenAIError(400, "stream_options is only allowed with stream=true", "stream_options")
    if body.deadline is not None and (not math.isfinite(body.deadline) or body.deadline < 0):
        raise OpenAIError(400, "deadline must be a finite number of seconds >= 0", "deadline")
    if body.request_id is not None and len(body.request_id) > MAX_REQUEST_ID_LEN:
        raise OpenAIError(
            400, f"request_id is longer than {MAX_REQUEST_ID_LEN} characters", "request_id"
        )


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_LEN for s in stops):
        raise OpenAIError(
            400,
            f"at most {MAX_STOP_STRINGS} stop strings of {MAX_STOP_STRING_LEN} characters",
            "stop",
        )
    return stops


def _sampling(body: _SamplingBody, max_tokens: int, logprobs: int | None) -> SamplingParams:
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
    if body.top_k is not None and body.top_k < -1:
        raise OpenAIError(400, f"top_k must be -1 or 0 (off) or >= 1; got {body.top_k}", "top_k")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise OpenAIError(
            400, f"logprobs must be in [0, {MAX_LOGPROBS}]; got {logprobs}", "logprobs"
        )
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=top_k,
        min_p=body.min_p,
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        stop_token_ids=list(body.stop_token_ids),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
    )
    validate_sampling_params(params)
    return params


def _state(
    intake: Intake,
    body: _SamplingBody,
    prompt: list[int],
    max_tokens: int,
    logprobs: int | None,
    request_id: str,
    structured: StructuredOutput | None,
) -> RequestState:
    params = _sampling(body, max_tokens, logprobs)
    params.structured = structured
    intake.check_token_ids(params.stop_token_ids)
    return intake.make_state(
        request_id=body.request_id or request_id,
        prompt=prompt,
        params=params,
        stop=_stop_strings(body.stop),
        priority=body.priority,
        tenant=body.tenant or None,
        deadline_s=body.deadline or 0.0,
        skip_special_tokens=body.skip_special_tokens,
    )


def completion_prompt(intake: Intake, prompt) -> list[int]:
    """A string, a list of token ids, or a one-element list of either."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise OpenAIError(
                400,
                f"one prompt per request (got {len(prompt)}); send them as separate requests",
                "prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise OpenAIError(400, "the prompt is empty", "prompt")
        return intake.tokenizer.encode(prompt)
    if not prompt:
        raise OpenAIError(400, "the prompt is empty", "prompt")
    return intake.check_token_ids(list(prompt))


def build_completion(intake: Intake, body: CompletionRequest) -> RequestState:
    _common_checks(body)
    if body.suffix:
        raise OpenAIError(400, "suffix is not supported", "suffix")
    if body.best_of is not None:
        if not body.n <= body.best_of <= MAX_CHOICES:
            raise OpenAIError(
                400, f"best_of must be in [n, {MAX_CHOICES}]; got {body.best_of}", "best_of"
            )
        if body.stream and body.best_of > body.n:
            raise OpenAIError(400, "best_of > n cannot be streamed", "best_of")
    if body.echo and body.logprobs is not None:
        raise OpenAIError(400, "echo with logprobs (prompt logprobs) is not supported", "echo")
    try:
        prompt = completion_prompt(intake, body.prompt)
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        request_id = f"cmpl-{uuid.uuid4().hex}"
        return _state(intake, body, prompt, max_tokens, body.logprobs, request_id, constraint(body))
    except RequestRejected as exc:
        raise OpenAIError(400, str(exc), None, "invalid_request") from exc


def _text_content(i: int, m: ChatMessage) -> str:
    if isinstance(m.content, list):
        texts = []
        for part in m.content:
            if part.type != "text" or part.text is None:
                raise OpenAIError(
                    400,
                    f"messages[{i}]: content part of type {part.type!r} is not supported; "
                    "this server takes text only",
                    f"messages.{i}.content",
                )
            texts.append(part.text)
        return "\n".join(texts)
    if m.content is None and m.role != "assistant":
        raise OpenAIError(
            400,
            f"messages[{i}]: a {m.role} message needs content (a string or text parts)",
            f"messages.{i}.content",
            "invalid_request",
        )
    return m.content or ""


def chat_messages(body: ChatCompletionRequest) -> list[dict]:
    """The messages as a chat template takes them: content always a string, an assistant's
    `tool_calls` and a tool message's `tool_call_id` and `name` kept."""
    messages = []
    for i, m in enumerate(body.messages):
        if m.tool_calls and m.role != "assistant":
            raise OpenAIError(
                400,
                f"messages[{i}]: only an assistant message carries tool_calls",
                f"messages.{i}.tool_calls",
            )
        role = "system" if m.role == "developer" else m.role
        message: dict = {"role": role, "content": _text_content(i, m)}
        if m.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        messages.append(message)
    return messages


def build_chat(
    intake: Intake, body: ChatCompletionRequest, tools: ToolPlan | None = None
) -> RequestState:
    """`tools`: the body's tool_plan, when the caller already has it."""
    _common_checks(body)
    tools = tools or tool_plan(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        if body.max_tokens != body.max_completion_tokens:
            raise OpenAIError(
                400, "max_tokens and max_completion_tokens differ; send one", "max_tokens"
            )
    structured = tool_constraint(tools, constraint(body, body.response_format))
    template = getattr(intake.tokenizer, "chat_template", None)
    messages, context = template_inputs(chat_messages(body), tools, template)
    try:
        prompt = render_prompt(intake, messages, context)
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        if max_tokens is None:  # as much as fits
            max_tokens = max(1, intake.max_model_len - len(prompt))
        return _state(
            intake,
            body,
            prompt,
            max_tokens,
            logprobs,
            f"chatcmpl-{uuid.uuid4().hex}",
            structured,
        )
    except RequestRejected as exc:
        raise OpenAIError(400, str(exc), None, "invalid_request") from exc


def render_prompt(intake: Intake, messages: list[dict], context: dict) -> list[int]:
    try:
        return intake.render_chat(messages, **context)
    except RequestRejected:
        raise
    except ValueError as exc:  # the template's raise_exception: it refuses these messages
        raise OpenAIError(400, str(exc), "messages") from exc


def choices(intake: Intake, body: _SamplingBody, first: RequestState) -> list[RequestState]:
    """n > 1 (and best_of): `first` and its siblings, one request per choice
    (Intake.siblings). best_of > n asks every choice for its sampled tokens' logprobs, to pick
    the n most likely."""
    count = max(body.n, getattr(body, "best_of", None) or body.n)
    if count == 1:
        return [first]
    if count > body.n and first.params.logprobs is None:
        first.params = replace(first.params, logprobs=0)
    return [first] + intake.siblings(
        first, count, _stop_strings(body.stop), body.deadline or 0.0, body.skip_special_tokens
    )
