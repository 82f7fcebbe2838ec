"""Request bodies of the OpenAI-compatible API (pydantic), with splitserve's extra fields.

Unknown fields are refused (400) so a misspelt parameter never passes silently; OpenAI fields
that splitserve accepts but does not act on are declared and documented as such. Types are
strict, as OpenAI's API checks them: "2" is not a number, 1 is not a boolean, NaN and Infinity
are not numbers; ranges are declared here, so a refusal names the field (http/errors.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from frontend_svc.intake import MAX_LOGPROBS, MAX_REQUEST_ID_LEN

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
INT32_MAX = 2**31 - 1  # the wire's int32 fields (top_k, min_tokens)
INT64 = (-(2**63), 2**63 - 1)  # the wire's seed


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


class _SamplingBody(BaseModel):
    """Fields common to both endpoints. n and best_of are checked in http/build.py; the
    remaining context, the vocabulary, priority, tenant and stop limits by the Intake."""

    model_config = STRICT

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    max_tokens: int | None = Field(None, ge=1)  # None: completions 16, chat all that fits
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])
    stop: str | list[str] | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    user: str | None = None  # accepted, not used
    logit_bias: dict[str, float] | None = None  # only empty: not supported
    # splitserve / vLLM extras (send them as extra body fields with the openai client)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # 0 or -1 disables
    min_p: float = Field(0.0, ge=0, le=1)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    repetition_penalty: float = Field(1.0, gt=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    skip_special_tokens: bool = True
    priority: int = 0  # lower value = more important (with --scheduling-policy priority)
    tenant: str | None = None
    deadline: float | None = Field(None, ge=0)  # seconds from now; a scheduling hint
    ttft_target_s: float | None = Field(None, ge=0, allow_inf_nan=False)  # first token within
    tpot_target_s: float | None = Field(None, ge=0, allow_inf_nan=False)  # mean token gap within
    request_id: str | None = Field(None, max_length=MAX_REQUEST_ID_LEN)
    # structured output, vLLM's fields: one of them (chat also takes response_format)
    structured_outputs: dict[str, Any] | None = (
        None  # {"json"|"regex"|"choice"|"grammar"|"json_object": ...}
    )
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # top-n per sampled token
    echo: bool = False
    suffix: str | None = None  # not supported: must be empty
    best_of: int | None = None  # only 1


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # other parts: refused by type
    type: str
    text: str | None = None


class FunctionDefinition(BaseModel):
    model_config = STRICT
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None  # accepted: required and named choices are always strict


class ToolDefinition(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # e.g. the client's parsed_arguments
    name: str
    arguments: str  # JSON text, as responses carry it


class MessageToolCall(BaseModel):
    """A call in an assistant message sent back: what a response's `tool_calls` held."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # e.g. refusal, audio: unused
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this answers


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: Any = None  # none | auto | required | {"type": "function", ...}: http/tools.py
    parallel_tool_calls: bool | None = None  # None: allowed
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema
    store: bool | None = None
    metadata: dict[str, str] | None = None
