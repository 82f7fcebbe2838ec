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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... are accepted, unused
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None  # not supported: must be empty
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema
    store: bool | None = None
    metadata: dict[str, str] | None = None
