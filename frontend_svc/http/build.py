"""OpenAI request bodies -> validated ClientRequests (through the same Intake as gRPC)."""

from __future__ import annotations

import json
import uuid
from dataclasses import replace

from common.messages import SamplingParams, StructuredOutput
from common.outcomes import RequestRejected
from frontend_svc.client_request import ClientRequest
from frontend_svc.http.completion_prompts import completion_prompts
from frontend_svc.http.constraints import constraint
from frontend_svc.http.errors import OpenAIError
from frontend_svc.http.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    Prediction,
    _SamplingBody,
)
from frontend_svc.http.template_vars import template_variables
from frontend_svc.http.tool_prompt import calls_are_tagged, template_inputs
from frontend_svc.http.tools import ToolPlan, tool_constraint, tool_plan
from frontend_svc.intake import MAX_CHOICES, Intake, check_stop_strings

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def check_model(intake: Intake, model: str | None) -> str:
    """The LoRA adapter `model` names ("" for the served model; None or "" means it); 404
    model_not_found for a model this server does not serve."""
    try:
        return intake.check_model(model or "")
    except RequestRejected as exc:
        raise OpenAIError(404, str(exc), "model", "model_not_found") from exc


def refused(exc: RequestRejected, renames: dict[str, str] | None = None) -> OpenAIError:
    """The Intake's refusal as a 400 naming the field as this body spells it (`renames`: the
    Intake's names, e.g. `prompt`, to this endpoint's, e.g. `messages`)."""
    field = getattr(exc, "field", None)
    if field is not None and renames:
        field = renames.get(field, field)
    message = str(exc)
    if field is not None and field not in message:
        message = f"{field}: {message}"
    return OpenAIError(400, message, field, "invalid_request")


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


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
    check_stop_strings(stops)
    return stops


def _sampling(body: _SamplingBody, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """The body's sampling values (their ranges: protocol.py; the rest: Intake.make_state)."""
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k if body.top_k is not None and body.top_k > 0 else 0,
        min_p=body.min_p,
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        stop_token_ids=list(body.stop_token_ids),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
    )


def _state(
    intake: Intake,
    body: _SamplingBody,
    prompt: list[int],
    max_tokens: int,
    logprobs: int | None,
    request_id: str,
    asked: tuple[str, StructuredOutput] | None,
) -> ClientRequest:
    intake.check_token_ids(body.stop_token_ids, "stop_token_ids")
    params = _sampling(body, max_tokens, logprobs)
    params.structured = asked[1] if asked else None
    params.prediction = prediction_ids(intake, getattr(body, "prediction", None))
    return intake.make_state(
        request_id=request_id,
        prompt=prompt,
        params=params,
        stop=_stop_strings(body.stop),
        priority=body.priority,
        tenant=body.tenant or None,
        deadline_s=body.deadline or 0.0,
        skip_special_tokens=body.skip_special_tokens,
        ttft_target_s=body.ttft_target_s or 0.0,
        tpot_target_s=body.tpot_target_s or 0.0,
        include_stop_str_in_output=body.include_stop_str_in_output,
    )


def prediction_ids(intake: Intake, prediction: Prediction | None) -> tuple[int, ...]:
    """Predicted Outputs: the text (a string, or text parts joined as they are) as token ids,
    the scheduler's drafts for this request (docs/speculative.md)."""
    if prediction is None:
        return ()
    if prediction.type != "content":
        raise OpenAIError(
            400,
            f"prediction of type {prediction.type!r} is not supported; use type 'content'",
            "prediction.type",
        )
    content = prediction.content
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise OpenAIError(
                    400,
                    "prediction: only text parts ({'type': 'text', 'text': ...}) are supported",
                    f"prediction.content.{j}",
                )
        content = "".join(part.text or "" for part in content)
    return intake.encode_prediction(content) if content else ()


def build_completion(intake: Intake, body: CompletionRequest) -> list[ClientRequest]:
    """One request per prompt (http/completion_prompts.py): the first has the body's
    request_id, prompt i after it `{request_id}-p{i}`."""
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
    asked = constraint(body)
    renames = {"structured": asked[0]} if asked else {}
    request_id = body.request_id or f"cmpl-{uuid.uuid4().hex}"
    states: list[ClientRequest] = []
    try:
        prompts = completion_prompts(intake, body.prompt, max(body.n, body.best_of or 1))
        for i, prompt in enumerate(prompts):
            if len(prompts) > 1:
                renames["prompt"] = f"prompt.{i}"
            max_tokens = intake.max_tokens_for(
                len(prompt), body.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS
            )
            rid = f"{request_id}-p{i}" if i else request_id
            states.append(_state(intake, body, prompt, max_tokens, body.logprobs, rid, asked))
    except RequestRejected as exc:
        raise refused(exc, renames) from exc
    return states


def _text_content(i: int, m: ChatMessage) -> str | None:
    """The content as one string; None when there is none (no content, or no parts)."""
    if isinstance(m.content, list):
        texts = []
        for j, part in enumerate(m.content):
            if part.type != "text":
                raise OpenAIError(
                    400,
                    f"messages[{i}]: content part of type {part.type!r} is not supported; "
                    "this server takes text only",
                    f"messages.{i}.content.{j}.type",
                )
            if part.text is None:
                raise OpenAIError(
                    400,
                    f"messages[{i}]: a text part needs its text",
                    f"messages.{i}.content.{j}.text",
                )
            texts.append(part.text)
        return "\n".join(texts) if texts else None
    return m.content


def _check_roles(i: int, m: ChatMessage, content: str | None, calls: set[str]) -> None:
    """What each role must carry, as OpenAI's API requires it: content (an assistant may send
    tool_calls instead), tool_calls only from the assistant, and tool_call_id only on, and on
    every, tool message, naming a call an earlier assistant message made."""
    if content is None and not (m.role == "assistant" and m.tool_calls):
        needs = "content or tool_calls" if m.role == "assistant" else "content"
        article = "an" if m.role == "assistant" else "a"
        raise OpenAIError(
            400,
            f"messages[{i}]: {article} {m.role} message needs {needs} "
            "(content: a string or text parts)",
            f"messages.{i}.content",
            "invalid_request",
        )
    if m.tool_calls and m.role != "assistant":
        raise OpenAIError(
            400,
            f"messages[{i}]: only an assistant message carries tool_calls",
            f"messages.{i}.tool_calls",
        )
    if m.role != "tool":
        if m.tool_call_id is not None:
            raise OpenAIError(
                400,
                f"messages[{i}]: only a tool message carries tool_call_id",
                f"messages.{i}.tool_call_id",
            )
        return
    if m.tool_call_id is None:
        raise OpenAIError(
            400,
            f"messages[{i}]: a tool message needs the tool_call_id of the call it answers",
            f"messages.{i}.tool_call_id",
        )
    if m.tool_call_id not in calls:
        raise OpenAIError(
            400,
            f"messages[{i}]: tool_call_id {m.tool_call_id!r} answers no tool call of an "
            "earlier assistant message",
            f"messages.{i}.tool_call_id",
        )


def chat_messages(body: ChatCompletionRequest) -> list[dict]:
    """The messages as a chat template takes them: content always a string, an assistant's
    `tool_calls` and a tool message's `tool_call_id` and `name` kept."""
    if not body.messages:
        raise OpenAIError(400, "messages is empty; send at least one message", "messages")
    messages = []
    calls: set[str] = set()  # the ids of the tool calls made so far
    for i, m in enumerate(body.messages):
        content = _text_content(i, m)
        _check_roles(i, m, content, calls)
        role = "system" if m.role == "developer" else m.role
        message: dict = {"role": role, "content": content or ""}
        if m.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in m.tool_calls]
            calls.update(call.id for call in m.tool_calls)
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        messages.append(message)
    return messages


def check_tool_parameters(intake: Intake, plan: ToolPlan | None) -> None:
    """Each tool's parameters compile as a JSON schema (OpenAI refuses an invalid one too),
    whether or not the choice constrains the output to them."""
    for i, tool in enumerate(plan.tools if plan is not None else ()):
        if tool.function.parameters is not None:
            schema = StructuredOutput("json_schema", json.dumps(tool.function.parameters))
            intake.check_constraint(schema, f"tools.{i}.function.parameters")


def build_chat(
    intake: Intake, body: ChatCompletionRequest, tools: ToolPlan | None = None
) -> ClientRequest:
    """`tools`: the body's tool_plan, when the caller already has it."""
    _common_checks(body)
    tools = tools or tool_plan(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if any(m != "text" for m in body.modalities or ()):
        raise OpenAIError(
            400,
            'this server generates text only; send modalities ["text"] or leave it out',
            "modalities",
        )
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        if body.max_tokens != body.max_completion_tokens:
            raise OpenAIError(
                400, "max_tokens and max_completion_tokens differ; send one", "max_tokens"
            )
    template = getattr(intake.tokenizer, "chat_template", None)
    asked = tool_constraint(
        tools, constraint(body, body.response_format), calls_are_tagged(template)
    )
    renames = {"prompt": "messages"}
    if body.max_completion_tokens is not None:
        renames["max_tokens"] = "max_completion_tokens"
    if asked is not None:
        renames["structured"] = asked[0]
    try:
        prompt = chat_prompt(intake, body, tools)
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        max_tokens = intake.max_tokens_for(len(prompt), max_tokens, None)  # None: all that fits
        request_id = body.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        return _state(intake, body, prompt, max_tokens, logprobs, request_id, asked)
    except RequestRejected as exc:
        raise refused(exc, renames) from exc


def chat_prompt(
    intake: Intake, body, tools: ToolPlan | None, add_generation_prompt: bool | None = None
) -> list[int]:
    """The body's messages (and tools) rendered by the chat template with the body's template
    variables (http/template_vars.py; `add_generation_prompt`: the caller's, else the body's),
    as token ids; raises RequestRejected for the caller to name the field."""
    messages = chat_messages(body)
    check_tool_parameters(intake, tools)
    special_tokens = getattr(intake.tokenizer, "special_tokens", None) or {}
    variables = template_variables(body, messages, special_tokens, add_generation_prompt)
    messages, context = template_inputs(
        messages, tools, getattr(intake.tokenizer, "chat_template", None)
    )
    return render_prompt(intake, messages, {**variables, **context})


def render_prompt(intake: Intake, messages: list[dict], context: dict) -> list[int]:
    try:
        return intake.render_chat(messages, **context)
    except RequestRejected:
        raise
    except ValueError as exc:  # the template's raise_exception: it refuses these messages
        raise OpenAIError(400, str(exc), "messages") from exc


def choices(intake: Intake, body: _SamplingBody, first: ClientRequest) -> list[ClientRequest]:
    """n > 1 (and best_of): `first` and its siblings, one request per choice
    (Intake.siblings). best_of > n asks every choice for its sampled tokens' logprobs, to pick
    the n most likely."""
    count = max(body.n, getattr(body, "best_of", None) or body.n)
    if count == 1:
        return [first]
    if count > body.n and first.params.logprobs is None:
        first.params = replace(first.params, logprobs=0)
    return [first] + intake.siblings(first, count)
