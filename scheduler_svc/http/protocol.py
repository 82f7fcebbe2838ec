"""Request bodies of the OpenAI-compatible API (pydantic), with splitserve's extra fields.

Unknown fields are refused (400) so a misspelt parameter never passes silently; OpenAI fields
that splitserve accepts but does not act on are declared and documented as such.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


class _SamplingBody(BaseModel):
    """Fields common to both endpoints."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None  # accepted, not used
    logit_bias: dict[str, float] | None = None  # only empty: not supported
    # splitserve / vLLM extras (send them as extra body fields with the openai client)
    top_k: int | None = None  # 0 or -1 disables
    min_p: float = 0.0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    skip_special_tokens: bool = True
    priority: int = 0  # lower value = more important (with --scheduling-policy priority)
    tenant: str | None = None
    deadline: float | None = None  # seconds from now; a scheduling hint
    request_id: str | None = None
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
    logprobs: int | None = None  # top-n log probabilities per sampled token
    echo: bool = False
    suffix: str | None = None  # not supported: must be empty
    best_of: int | None = None  # only 1


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None  # accepted: required and named choices are always strict


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")  # e.g. the client's own parsed_arguments
    name: str
    arguments: str  # JSON text, as responses carry it


class MessageToolCall(BaseModel):
    """A call in an assistant message sent back: what a response's `tool_calls` held."""

    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. refusal, audio: accepted, unused
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this answers


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Any = None  # none | auto | required | {"type": "function", ...}: http/tools.py
    parallel_tool_calls: bool | None = None  # None: allowed
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema
    store: bool | None = None
    metadata: dict[str, str] | None = None
