"""POST /tokenize and /detokenize, as vLLM serves them: a prompt (or chat messages, rendered by
the chat template exactly as /v1/chat/completions renders them, tools included) to the token ids
the model would see, and token ids back to text."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from common.outcomes import RequestRejected
from frontend_svc.http.build import chat_prompt, check_model, refused
from frontend_svc.http.context import HttpContext
from frontend_svc.http.errors import OpenAIError
from frontend_svc.http.protocol import STRICT, ChatMessage, ToolDefinition, non_empty
from frontend_svc.http.tools import tool_plan

MAX_TOKENIZE_CHARS = 1_000_000
# the route refuses neither and both (it names `prompt`); the schema says the same
ONE_OF_PROMPT_OR_MESSAGES = {
    "oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
    ]
}


class TokenizeRequest(BaseModel):
    """One of `prompt` (completion style) or `messages` (chat style)."""

    model_config = ConfigDict(**STRICT, json_schema_extra=ONE_OF_PROMPT_OR_MESSAGES)
    model: str | None = None
    prompt: str | None = Field(None, max_length=MAX_TOKENIZE_CHARS)
    messages: list[ChatMessage] | None = Field(None, json_schema_extra=non_empty)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[int]


class _ChatView(BaseModel):
    """What build.py's chat helpers read from a chat body."""

    model_config = ConfigDict(extra="ignore")
    messages: list[ChatMessage]
    tools: list[ToolDefinition] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


def tokenize_router(ctx: HttpContext) -> APIRouter:
    router = APIRouter()
    intake = ctx.intake

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        """A prompt certainly over max_model_len (Intake.check_text_length) is refused as
        /v1/completions refuses it, uncounted; any other gets its count."""
        check_model(intake, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "send either prompt or messages", "prompt")
        # beside the event loop, as the completion routes tokenize
        return await asyncio.to_thread(_tokenize, intake, body)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(intake, body.model)
        try:
            intake.check_token_ids(body.tokens, "tokens")
        except RequestRejected as exc:
            raise refused(exc) from exc
        return {"prompt": intake.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    return router


def _tokenize(intake, body: TokenizeRequest) -> dict:
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        try:
            tokens = intake.encode_prompt(body.prompt, add_special_tokens=add_special)
        except RequestRejected as exc:
            raise refused(exc) from exc
    else:
        tokens = _chat_tokens(intake, body)
    reply: dict = {"count": len(tokens), "max_model_len": intake.max_model_len}
    reply["tokens"] = tokens
    reply["token_strs"] = (
        [intake.tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
        if body.return_token_strs
        else None
    )
    return reply


def _chat_tokens(intake, body: TokenizeRequest) -> list[int]:
    chat = _ChatView(messages=body.messages or [], tools=body.tools)
    try:
        tokens = chat_prompt(intake, chat, tool_plan(chat), body.add_generation_prompt)
    except RequestRejected as exc:
        raise refused(exc, {"prompt": "messages"}) from exc
    if body.add_special_tokens:  # the template writes its own; a BOS on top, if asked
        bos = intake.tokenizer.bos_token_id
        if bos is not None and tokens[:1] != [bos]:
            tokens = [bos, *tokens]
    return tokens
