"""The 200 bodies /openapi.json declares (http/openapi.py): what format.py, openai_routes.py and
tokenize_routes.py write, described for clients. The routes build their bodies as dicts; these
models are never instantiated. Open to more fields (extra="allow"), as OpenAI's objects grow."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

OPEN = ConfigDict(extra="allow")


class Usage(BaseModel):
    model_config = OPEN
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    model_config = OPEN
    index: int
    text: str
    logprobs: dict | None
    finish_reason: str | None  # stop, length, abort, error, shed
    stop_reason: int | str | None = None  # the stop token id or string that ended it


class Completion(BaseModel):
    """POST /v1/completions without stream (one choice per prompt and n)."""

    model_config = OPEN
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CalledFunctionOut(BaseModel):
    model_config = OPEN
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    model_config = OPEN
    id: str
    type: Literal["function"]
    function: CalledFunctionOut


class AssistantMessage(BaseModel):
    model_config = OPEN
    role: Literal["assistant"]
    content: str | None  # None: the message only calls tools
    tool_calls: list[ToolCallOut] | None = None
    function_call: CalledFunctionOut | None = None  # a request that sent `functions`


class ChatChoice(BaseModel):
    model_config = OPEN
    index: int
    message: AssistantMessage
    logprobs: dict | None
    finish_reason: str | None  # also tool_calls, function_call
    stop_reason: int | str | None = None


class ChatCompletion(BaseModel):
    """POST /v1/chat/completions without stream."""

    model_config = OPEN
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    model_config = OPEN
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    model_config = OPEN
    object: Literal["list"]
    data: list[ModelCard]


class Tokenized(BaseModel):
    model_config = OPEN
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None  # with return_token_strs


class Detokenized(BaseModel):
    model_config = OPEN
    prompt: str


# the operations whose 200 application/json body a model describes
ANSWER_MODELS: dict[str, type[BaseModel]] = {
    "POST /v1/completions": Completion,
    "POST /v1/chat/completions": ChatCompletion,
    "GET /v1/models": ModelList,
    "GET /v1/models/{model_id}": ModelCard,
    "POST /tokenize": Tokenized,
    "POST /detokenize": Detokenized,
}
