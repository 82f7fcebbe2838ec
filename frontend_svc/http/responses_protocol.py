"""The /v1/responses request body (OpenAI's Responses API), under protocol.py's conventions:
unknown fields refused, strict types, ranges declared here.

`input` items and `tools` are checked one by one in http/responses_build.py (against the item
and tool models below), so that an item or tool of a kind this server does not run is refused
with a sentence naming it rather than as a failed union. Fields declared only to be refused with
a reason (background, conversation, prompt, ...) are refused there too.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from frontend_svc.http.protocol import STRICT

TEXT_PARTS = ("input_text", "output_text")


class ContentPart(BaseModel):
    """A message's content part: text parts are read, every other type refused by name (so
    their fields, image_url, file_id..., are let through to that refusal)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None
    refusal: str | None = None  # an assistant's refusal part, sent back: read as its text


class MessageItem(BaseModel):
    """A message; also an output `message` item sent back as it came (id, status, phase)."""

    model_config = STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(BaseModel):
    """A call the model made (an output `function_call` item sent back)."""

    model_config = STRICT
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    parsed_arguments: Any = None  # what the client's parse and stream helpers add: not read


class FunctionCallOutputItem(BaseModel):
    """The result of a call, answering the `function_call` with the same call_id."""

    model_config = STRICT
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
ITEM_MODELS: dict[str, type[BaseModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}


class FunctionTool(BaseModel):
    """A function tool, in the Responses shape (flat: no `function` object)."""

    model_config = STRICT
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None  # accepted: tool_choice required and named are always strict


class TextFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # json_schema
    description: str | None = None  # json_schema: accepted, not shown to the model
    strict: bool | None = None  # json_schema: the output always matches the schema


class TextConfig(BaseModel):
    model_config = STRICT
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, not used


class ReasoningConfig(BaseModel):
    """Accepted and echoed; no reasoning effort reaches the model (no reasoning items)."""

    model_config = STRICT
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: str | None = None


class ResponsesStreamOptions(BaseModel):
    model_config = STRICT
    include_obfuscation: bool = False  # accepted: events carry no obfuscation padding


class ResponsesRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    input: str | list[dict[str, Any]]  # each item: http/responses_build.py
    instructions: str | None = None  # a system message first; not carried to the next turn
    previous_response_id: str | None = None
    store: bool | None = None  # None: kept, as OpenAI does (http/responses_store.py)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list[dict[str, Any]] | None = None  # function tools only
    tool_choice: Any = None  # none | auto | required | {"type": "function", "name": ...}
    parallel_tool_calls: bool | None = None  # None: allowed
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)  # None: all that fits
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None  # only "disabled"
    include: list[str] | None = None  # only "reasoning.encrypted_content" (nothing to add)
    # accepted, echoed, not used
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # declared to be refused with a reason (http/responses_build.py)
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
