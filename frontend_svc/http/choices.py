"""n > 1 and best_of: one request per choice (http/build.py `choices`), answered as one
response whose choices carry their index, or one stream whose chunks do. Usage counts the
prompt once and every generated token. best_of > n keeps the n choices whose sampled tokens
are most likely (highest sum of logprobs)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common.logging import get_logger
from common.outcomes import Overloaded, RequestRejected
from frontend_svc.client_request import ClientRequest, StreamDelta
from frontend_svc.http.context import HttpContext
from frontend_svc.http.errors import OpenAIError, error_body
from frontend_svc.http.format import ResponseFormatter, usage
from frontend_svc.http.streams import DisconnectWatcher, sse

log = get_logger("splitserve.http")
CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection"


def submit_or_raise(ctx: HttpContext, state: ClientRequest) -> None:
    scheduler = ctx.scheduler
    try:
        scheduler.submit(state)
    except Overloaded as exc:
        ctx.rejected("overloaded")
        raise OpenAIError(
            429, str(exc), None, "rate_limit_exceeded", retry_after_s=exc.retry_after_s
        ) from exc
    except RequestRejected as exc:
        ctx.rejected("invalid")
        raise OpenAIError(400, str(exc), None, "invalid_request") from exc


def likelihood(deltas: list[StreamDelta]) -> float:
    return sum(lp.logprob for d in deltas for lp in d.logprobs or ())


async def serve_choices(
    ctx: HttpContext,
    request: Request,
    states: list[ClientRequest],
    formatter: Callable[[int], ResponseFormatter],
    n: int,
    stream: bool,
    opts,
) -> Response:
    submitted: list[ClientRequest] = []
    watcher: DisconnectWatcher | None = None
    streaming = False
    try:
        for state in states:
            submit_or_raise(ctx, state)
            submitted.append(state)
        log.info(
            "request_accepted",
            request_id=states[0].request_id,
            api="http",
            choices=len(states),
            prompt_tokens=len(states[0].prompt_token_ids),
            stream=bool(stream),
        )
        watcher = DisconnectWatcher(request.receive)
        fmts = [formatter(i) for i in range(len(states))]
        if stream:
            streaming = True
            events = _events(ctx, states, fmts, watcher, opts)
            headers = {"X-Request-Id": states[0].request_id, "Cache-Control": "no-cache"}
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        results = await asyncio.gather(*(_collect(watcher, s) for s in states))
        if any(r is None for r in results):
            return Response(status_code=CLIENT_CLOSED)
        generated = sum(r[-1].num_output_tokens for r in results if r)
        ranked = list(range(len(states)))
        if len(states) > n:  # best_of: the n most likely, in that order
            ranked = sorted(ranked, key=lambda i: likelihood(results[i]), reverse=True)[:n]
        body = fmts[0].response(results[ranked[0]])
        body["choices"] = []
        for index, i in enumerate(ranked):
            fmts[i].index = index
            body["choices"] += fmts[i].response(results[i])["choices"]
        body["usage"] = usage(fmts[0].prompt_tokens, generated)
        return JSONResponse(body, headers={"X-Request-Id": states[0].request_id})
    finally:
        if not streaming:
            if watcher is not None:
                watcher.close()
            for state in submitted:
                if not state.finished:
                    ctx.scheduler.drop(state.request_id)


async def _collect(watcher: DisconnectWatcher, state: ClientRequest) -> list[StreamDelta] | None:
    deltas: list[StreamDelta] = []
    while not deltas or deltas[-1].finish_reason is None:
        delta = await watcher.next(state)
        if delta is None:
            return None
        if delta.error:
            raise OpenAIError.from_error_code(delta.error_code, delta.error)
        deltas.append(delta)
    return deltas


async def _events(ctx, states, fmts: list[ResponseFormatter], watcher, opts):
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    arrivals: asyncio.Queue[tuple[int, StreamDelta | None]] = asyncio.Queue()

    async def pump(i: int, state: ClientRequest) -> None:
        while True:
            delta = await watcher.next(state)
            arrivals.put_nowait((i, delta))
            if delta is None or delta.finish_reason is not None or delta.error:
                return

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(states)]
    prompt_tokens = fmts[0].prompt_tokens
    generated = [0] * len(states)
    prefixes = [f.echo_text for f in fmts]
    try:
        if fmts[0].chat:
            for fmt in fmts:
                head = fmt.first_chat_chunk()
                if include_usage:
                    head["usage"] = usage(prompt_tokens, 0) if continuous else None
                yield sse(head)
        open_choices = len(states)
        while open_choices:
            i, delta = await arrivals.get()
            if delta is None:
                log.info("request_cancelled", request_id=states[0].request_id, api="http")
                return
            if delta.error:
                err = OpenAIError.from_error_code(delta.error_code, delta.error)
                yield sse(error_body(err.status, err.message, None, err.code))
                return
            generated[i] = delta.num_output_tokens
            chunk = fmts[i].chunk(delta, prefixes[i])
            prefixes[i] = ""
            if include_usage:
                chunk["usage"] = usage(prompt_tokens, sum(generated)) if continuous else None
            yield sse(chunk)
            if delta.finish_reason is not None:
                open_choices -= 1
        if include_usage:
            yield sse(fmts[0].usage_chunk(sum(generated)))
        yield sse("[DONE]")
    finally:
        for task in pumps:
            task.cancel()
        watcher.close()
        for state in states:
            if not state.finished:
                ctx.scheduler.drop(state.request_id)
