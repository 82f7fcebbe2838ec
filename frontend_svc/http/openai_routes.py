"""/v1/completions, /v1/chat/completions, /v1/models: OpenAI's API over the ServingEngine."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common.logging import get_logger
from frontend_svc.client_request import ClientRequest, StreamDelta
from frontend_svc.http.build import build_chat, build_completion, check_model, choices
from frontend_svc.http.choices import (
    CLIENT_CLOSED,
    collect_deltas,
    serve_choices,
    submit_or_raise,
)
from frontend_svc.http.context import HttpContext
from frontend_svc.http.errors import OpenAIError, error_body
from frontend_svc.http.format import ResponseFormatter, usage
from frontend_svc.http.prediction import add_prediction_usage
from frontend_svc.http.protocol import ChatCompletionRequest, CompletionRequest
from frontend_svc.http.streams import DisconnectWatcher, sse
from frontend_svc.http.tools import tool_plan

log = get_logger("splitserve.http")
Built = TypeVar("Built")


def openai_router(ctx: HttpContext) -> APIRouter:
    router = APIRouter(prefix="/v1")
    scheduler, intake = ctx.scheduler, ctx.intake

    def model_card() -> dict:
        return {
            "id": intake.model_name,
            "object": "model",
            "created": int(ctx.started_at),
            "owned_by": "splitserve",
            "root": scheduler.model_name,
            "max_model_len": intake.max_model_len,
        }

    def adapter_cards() -> dict[str, dict]:
        """The LoRA adapters, as vLLM lists them: the base model their parent."""
        return {
            a.name: {
                "id": a.name,
                "object": "model",
                "created": int(ctx.started_at),
                "owned_by": "splitserve",
                "root": a.path,
                "parent": intake.model_name,
                "max_model_len": intake.max_model_len,
            }
            for a in scheduler.lora_adapters()
        }

    @router.get("/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card(), *adapter_cards().values()]}

    @router.get("/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        if check_model(intake, model_id):
            card = adapter_cards().get(model_id)
            if card is not None:
                return card
        return model_card()

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        lora_name = check_model(intake, body.model)
        states = await _built_beside(ctx, lambda: build_completion(intake, body))
        for state in states:
            state.lora_name = lora_name
        groups = [_built(ctx, lambda s=s: choices(intake, body, s)) for s in states]

        def fmt(state: ClientRequest, index: int = 0) -> ResponseFormatter:
            echo = intake.tokenizer.decode(state.prompt_token_ids) if body.echo else ""
            return ResponseFormatter(
                chat=False,
                request_id=states[0].request_id,
                model=body.model or intake.model_name,
                prompt_tokens=len(state.prompt_token_ids),
                tokenizer=intake.tokenizer,
                want_logprobs=body.logprobs is not None,
                echo_text=echo,
                index=index,
            )

        if len(groups) > 1 or len(groups[0]) > 1:
            return await serve_choices(
                ctx, request, groups, fmt, body.n, body.stream, body.stream_options
            )
        state = states[0]
        return await _serve(ctx, request, state, fmt(state), body.stream, body.stream_options)

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        lora_name = check_model(intake, body.model)
        tools = _built(ctx, lambda: tool_plan(body))
        state = await _built_beside(ctx, lambda: build_chat(intake, body, tools))
        state.lora_name = lora_name
        group = _built(ctx, lambda: choices(intake, body, state))

        def fmt(_: ClientRequest | None = None, index: int = 0) -> ResponseFormatter:
            return ResponseFormatter(
                chat=True,
                request_id=state.request_id,
                model=body.model or intake.model_name,
                prompt_tokens=len(state.prompt_token_ids),
                tokenizer=intake.tokenizer,
                want_logprobs=body.logprobs,
                index=index,
                tools=tools,
            )

        if len(group) > 1:
            return await serve_choices(
                ctx, request, [group], fmt, body.n, body.stream, body.stream_options
            )
        return await _serve(ctx, request, state, fmt(), body.stream, body.stream_options)

    return router


async def _built_beside(ctx: HttpContext, build: Callable[[], Built]) -> Built:
    """_built, on a thread: building renders the chat template, tokenizes (a microsecond a
    byte) and may compile a grammar; the tokenizer and llguidance let go of the GIL meanwhile,
    so the event loop (in one process with the scheduler, its step loop) and every other
    client's stream go on."""
    try:
        return await asyncio.to_thread(build)
    except OpenAIError:
        ctx.rejected("invalid")
        raise


def _built(ctx: HttpContext, build: Callable[[], Built]) -> Built:
    try:
        return build()
    except OpenAIError:
        ctx.rejected("invalid")
        raise


async def _serve(
    ctx: HttpContext, request: Request, state: ClientRequest, fmt: ResponseFormatter, stream, opts
) -> Response:
    scheduler = ctx.scheduler
    submit_or_raise(ctx, state)
    log.info(
        "request_accepted",
        request_id=state.request_id,
        api="http",
        prompt_tokens=fmt.prompt_tokens,
        max_tokens=state.params.max_tokens,
        stream=bool(stream),
    )
    watcher = DisconnectWatcher(request.receive)
    streaming = False
    try:
        # wait for the first delta before answering, so an early error gets its HTTP status
        first = await watcher.next(state)
        if first is None:
            return client_gone(state)
        if first.error:
            raise OpenAIError.from_error_code(first.error_code, first.error)
        headers = {"X-Request-Id": state.request_id}
        if stream:
            streaming = True
            events = _events(ctx, state, fmt, first, watcher, opts)
            return StreamingResponse(
                events,
                media_type="text/event-stream",
                headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        deltas = await collect_deltas(watcher, state, [first])
        if deltas is None:
            return client_gone(state)
        log_finished(state, deltas[-1])
        body = fmt.response(deltas)
        await add_prediction_usage(body.get("usage"), [state])
        return JSONResponse(body, headers=headers)
    finally:
        if not streaming:  # the stream's generator cleans up after itself
            watcher.close()
            if not state.finished:
                scheduler.drop(state.request_id)


def client_gone(state: ClientRequest) -> Response:
    log.info("request_cancelled", request_id=state.request_id, api="http")
    return Response(status_code=CLIENT_CLOSED)


def log_finished(state: ClientRequest, last: StreamDelta) -> None:
    log.info(
        "request_finished",
        request_id=state.request_id,
        api="http",
        finish_reason=str(last.finish_reason),
        output_tokens=last.num_output_tokens,
        worker_id=last.worker_id,
    )


async def _events(ctx, state, fmt: ResponseFormatter, first, watcher: DisconnectWatcher, opts):
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    try:
        if fmt.chat:
            head = fmt.first_chat_chunk()
            if include_usage:
                head["usage"] = usage(fmt.prompt_tokens, 0) if continuous else None
            yield sse(head)
        delta: StreamDelta | None = first
        prefix = fmt.echo_text
        while delta is not None:
            if delta.error:
                err = OpenAIError.from_error_code(delta.error_code, delta.error)
                yield sse(error_body(err.status, err.message, None, err.code))
                break
            chunk = fmt.chunk(delta, prefix)
            prefix = ""
            if include_usage:
                chunk["usage"] = (
                    usage(fmt.prompt_tokens, delta.num_output_tokens) if continuous else None
                )
            yield sse(chunk)
            if delta.finish_reason is not None:
                log_finished(state, delta)
                if include_usage:
                    last = fmt.usage_chunk(delta.num_output_tokens)
                    await add_prediction_usage(last.get("usage"), [state])
                    yield sse(last)
                break
            delta = await watcher.next(state)
        if delta is None:
            log.info("request_cancelled", request_id=state.request_id, api="http")
            return
        yield sse("[DONE]")
    finally:
        watcher.close()
        if not state.finished:  # client gone (or the server stopping the response)
            ctx.scheduler.drop(state.request_id)
