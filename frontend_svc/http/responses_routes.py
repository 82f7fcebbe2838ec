"""/v1/responses: OpenAI's Responses API on the chat completions pipeline.

POST translates the body into a chat request (http/responses_build.py), which http/build.py
renders, tokenizes and constrains as for /v1/chat/completions; the output is read by the same
formatter (http/format.py: text and tool calls) and answered as a response object
(http/responses_render.py) or its events (http/responses_stream.py). Responses are kept
(http/responses_store.py) for `previous_response_id` and GET / DELETE /v1/responses/{id}.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common.logging import get_logger
from frontend_svc.client_request import ClientRequest, StreamDelta
from frontend_svc.http.build import build_chat, check_model
from frontend_svc.http.choices import collect_deltas, submit_or_raise
from frontend_svc.http.context import HttpContext
from frontend_svc.http.errors import OpenAIError
from frontend_svc.http.format import ResponseFormatter
from frontend_svc.http.openai_routes import client_gone, log_finished
from frontend_svc.http.responses_build import renamed, translate
from frontend_svc.http.responses_protocol import ResponsesRequest
from frontend_svc.http.responses_render import (
    ResponseShape,
    new_id,
    output_items,
    status_of,
    usage,
)
from frontend_svc.http.responses_store import ResponseStore
from frontend_svc.http.responses_stream import ResponseEvents
from frontend_svc.http.streams import DisconnectWatcher
from frontend_svc.http.tools import tool_plan

log = get_logger("splitserve.http")
Built = TypeVar("Built")
Keep = Callable[[dict], object]


def responses_router(ctx: HttpContext, store: ResponseStore | None = None) -> APIRouter:
    router = APIRouter(prefix="/v1")
    intake = ctx.intake
    kept = store if store is not None else ResponseStore()

    @router.post("/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        lora_name = check_model(intake, body.model)
        history = _previous(ctx, kept, body.previous_response_id)
        response_id = new_id("resp")
        plan = _checked(ctx, lambda: translate(body, history, response_id))
        tools = _checked(ctx, lambda: tool_plan(plan.chat))
        state = await _checked_beside(ctx, lambda: build_chat(intake, plan.chat, tools))
        state.lora_name = lora_name
        shape = ResponseShape(body, response_id, body.model or intake.model_name, plan.tools)
        fmt = ResponseFormatter(
            chat=True,
            request_id=state.request_id,
            model=shape.model,
            prompt_tokens=len(state.prompt_token_ids),
            tokenizer=intake.tokenizer,
            tools=tools,
        )

        def keep(response: dict) -> None:
            if body.store is not False and response["status"] != "failed":
                kept.put(response, plan.conversation + response["output"])

        return await _serve(ctx, request, state, fmt, shape, body.stream, keep)

    @router.get("/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        return _stored(kept, response_id, "response_id").response

    @router.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        _stored(kept, response_id, "response_id")
        kept.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router


def _stored(kept: ResponseStore, response_id: str, param: str):
    stored = kept.get(response_id)
    if stored is None:
        raise OpenAIError(
            404,
            f"Response with id {response_id!r} not found: this front-end never stored it "
            f"(store=false, or made on another front-end), or it passed its {kept.ttl_s:.0f} s "
            "or was pushed out by newer ones",
            param,
            "response_not_found",
        )
    return stored


def _previous(ctx: HttpContext, kept: ResponseStore, response_id: str | None) -> list[dict]:
    if response_id is None:
        return []
    try:
        return _stored(kept, response_id, "previous_response_id").conversation
    except OpenAIError:
        ctx.rejected("invalid")
        raise


def _checked(ctx: HttpContext, build: Callable[[], Built]) -> Built:
    try:
        return build()
    except OpenAIError as err:
        ctx.rejected("invalid")
        raise renamed(err) from err


async def _checked_beside(ctx: HttpContext, build: Callable[[], Built]) -> Built:
    """On a thread, as openai_routes builds chat requests: rendering, tokenizing and compiling
    a grammar let go of the GIL, so the event loop goes on meanwhile."""
    try:
        return await asyncio.to_thread(build)
    except OpenAIError as err:
        ctx.rejected("invalid")
        raise renamed(err) from err


def _ended_early(finish: str | None) -> dict:
    return {"code": "server_error", "message": f"the generation ended early ({finish})"}


async def _serve(
    ctx: HttpContext,
    request: Request,
    state: ClientRequest,
    fmt: ResponseFormatter,
    shape: ResponseShape,
    stream: bool,
    keep: Keep,
) -> Response:
    submit_or_raise(ctx, state)
    log.info(
        "request_accepted",
        request_id=state.request_id,
        api="http",
        endpoint="responses",
        prompt_tokens=fmt.prompt_tokens,
        max_tokens=state.params.max_tokens,
        stream=stream,
    )
    watcher = DisconnectWatcher(request.receive)
    streaming = False
    try:
        # the first delta before answering, so that an early error gets its HTTP status
        first = await watcher.next(state)
        if first is None:
            return client_gone(state)
        if first.error:
            raise OpenAIError.from_error_code(first.error_code, first.error)
        headers = {"X-Request-Id": state.request_id}
        if stream:
            streaming = True
            events = _events(ctx, state, fmt, shape, first, watcher, keep)
            headers |= {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        deltas = await collect_deltas(watcher, state, [first])
        if deltas is None:
            return client_gone(state)
        log_finished(state, deltas[-1])
        choice = fmt.response(deltas)["choices"][0]
        finish, status = choice["finish_reason"], status_of(choice["finish_reason"])
        used = usage(fmt.prompt_tokens, deltas[-1].num_output_tokens)
        error = _ended_early(finish) if status == "failed" else None
        response = shape.object(
            status, output_items(choice["message"], status), used, finish, error
        )
        keep(response)
        return JSONResponse(response, headers=headers)
    finally:
        if not streaming:  # the stream's generator cleans up after itself
            watcher.close()
            if not state.finished:
                ctx.scheduler.drop(state.request_id)


async def _events(ctx, state, fmt, shape, first: StreamDelta, watcher: DisconnectWatcher, keep):
    events = ResponseEvents(shape)
    try:
        yield "".join(events.start())
        delta: StreamDelta | None = first
        while delta is not None:
            if delta.error:
                err = OpenAIError.from_error_code(delta.error_code, delta.error)
                code = "rate_limit_exceeded" if err.status == 429 else "server_error"
                yield "".join(events.fail(err.message, code))
                break
            choice = fmt.chunk(delta)["choices"][0]
            out = events.feed(choice["delta"])
            finish = choice["finish_reason"]
            if finish is not None:
                log_finished(state, delta)
                status = status_of(finish)
                if status == "failed":
                    out += events.fail(**_ended_early(finish))
                else:
                    used = usage(fmt.prompt_tokens, delta.num_output_tokens)
                    out += events.finish(status, used, finish)
                    keep(events.final)
            if out:
                yield "".join(out)
            if finish is not None:
                break
            delta = await watcher.next(state)
        if delta is None:
            log.info("request_cancelled", request_id=state.request_id, api="http")
    finally:
        watcher.close()
        if not state.finished:  # client gone (or the server stopping the response)
            ctx.scheduler.drop(state.request_id)
