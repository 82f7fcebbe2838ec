"""Request bodies of the OpenAI-compatible API (pydantic), with splitserve's extra fields.

Unknown fields are refused (400) so a misspelt parameter never passes silently; OpenAI fields
that splitserve accepts but does not act on are declared and documented as such. Types are
strict, as OpenAI's API checks them: "2" is not a number, 1 is not a boolean, NaN and Infinity
are not numbers; ranges are declared here, so a refusal names the field (http/errors.py).
Where a route refuses a value with a sentence of its own (build.py, completion_prompts.py,
the Intake), the field's `json_schema_extra` states the same rule for /openapi.json, so that
the schema allows no body the server refuses for a reason a schema can say (test_openapi.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from common.outcomes import PRIORITY_RANGE
from frontend_svc.intake import MAX_CHOICES, MAX_LOGPROBS, MAX_REQUEST_ID_LEN

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
INT32_MAX = 2**31 - 1  # the wire's int32 fields (top_k, min_tokens)
INT64 = (-(2**63), 2**63 - 1)  # the wire's seed
PRIORITY = {"minimum": PRIORITY_RANGE[0], "maximum": PRIORITY_RANGE[1]}  # the Intake's check


def non_empty(schema: dict[str, Any]) -> None:
    """A field's JSON schema: each string and list in it must be non-empty. For the fields whose
    emptiness the routes refuse with a sentence of their own ("prompt[1] is empty"), so that
    /openapi.json does not allow what the server refuses (http/openapi.py)."""
    kind = schema.get("type")
    if kind == "string":
        schema["minLength"] = max(1, schema.get("minLength", 0))
    elif kind == "array":
        schema["minItems"] = max(1, schema.get("minItems", 0))
    for inner in [*schema.get("anyOf", ()), schema.get("items")]:
        if isinstance(inner, dict) and "$ref" not in inner:
            non_empty(inner)


def text_part(schema: dict[str, Any]) -> None:
    """A content part's JSON schema: {"type": "text", "text": ...} only, as build.py takes."""
    schema["properties"]["type"] = {"const": "text"}
    schema["properties"]["text"] = {"type": "string"}
    schema["required"] = ["type", "text"]


# build.py's _check_roles as /openapi.json states it: content (an assistant may call tools
# instead), tool_calls only from the assistant, tool_call_id on tool messages only. That a tool
# message answers a call an earlier message made, no schema can say.
ROLE_RULES = {
    "allOf": [
        {
            "if": {"properties": {"role": {"const": "assistant"}}},
            "then": {
                "anyOf": [
                    {
                        "required": ["content"],
                        "properties": {"content": {"type": ["string", "array"], "minItems": 1}},
                    },
                    {
                        "required": ["tool_calls"],
                        "properties": {"tool_calls": {"type": "array", "minItems": 1}},
                    },
                ]
            },
            "else": {
                "required": ["content"],
                "properties": {
                    "content": {"type": ["string", "array"], "minItems": 1},
                    "tool_calls": {"maxItems": 0},
                },
            },
        },
        {
            "if": {"properties": {"role": {"const": "tool"}}},
            "then": {
                "required": ["tool_call_id"],
                "properties": {"tool_call_id": {"type": "string"}},
            },
            "else": {"properties": {"tool_call_id": {"type": "null"}}},
        },
    ]
}


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk
    include_obfuscation: bool = False  # OpenAI's: accepted, no obfuscation field is sent


class PredictionPart(BaseModel):
    # other parts: refused by type
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=text_part)
    type: str
    text: str | None = None


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: the text the output is expected to be (http/build.py)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: str = Field(json_schema_extra={"const": "content"})  # only "content": build.py
    content: str | list[PredictionPart]


class _SamplingBody(BaseModel):
    """Fields common to both endpoints. n and best_of are checked in http/build.py; the
    remaining context, the vocabulary, priority, tenant and stop limits by the Intake."""

    model_config = STRICT

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, json_schema_extra={"minimum": 1, "maximum": MAX_CHOICES})
    max_tokens: int | None = Field(None, ge=1)  # None: completions 16, chat all that fits
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])
    stop: str | list[str] | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    user: str | None = None  # accepted, not used
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={"maxProperties": 0})
    # splitserve / vLLM extras (send them as extra body fields with the openai client)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # 0 or -1 disables
    min_p: float = Field(0.0, ge=0, le=1)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    repetition_penalty: float = Field(1.0, gt=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM's: a matched stop string stays in the text
    # lower value = more important (with --scheduling-policy priority)
    priority: int = Field(0, json_schema_extra=PRIORITY)
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
    prompt: str | list[int] | list[str] | list[list[int]] = Field(json_schema_extra=non_empty)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # top-n per sampled token
    echo: bool = False
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0})  # not supported
    best_of: int | None = Field(None, json_schema_extra={"minimum": 1, "maximum": MAX_CHOICES})
    prediction: Prediction | None = None  # drafts for speculative decoding


class TextPart(BaseModel):
    # other parts: refused by type (build.py)
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=text_part)
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
    # extra: e.g. refusal, audio: unused
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=ROLE_RULES)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this answers


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage] = Field(json_schema_extra=non_empty)  # build.chat_messages
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: Any = None  # none | auto | required | {"type": "function", ...}: http/tools.py
    parallel_tool_calls: bool | None = None  # None: allowed
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema
    prediction: Prediction | None = None  # drafts for speculative decoding
    # OpenAI's labels and routing hints: accepted, not used (docs/operations.md)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    modalities: list[str] | None = None  # only ["text"] (http/build.py)
    # the chat template's variables (http/template_vars.py)
    reasoning_effort: ReasoningEffort | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more template variables
    add_generation_prompt: bool = True  # vLLM's
    continue_final_message: bool = False  # vLLM's: the last (assistant) message goes on
    # the legacy function calling, read as tools / tool_choice (http/tools.py)
    functions: list[FunctionDefinition] | None = None
    function_call: Any = None  # none | auto | {"name": ...}
