"""n > 1, best_of and a list of prompts: one request per choice (http/build.py `choices`), in
one group per prompt, answered as one response whose choices carry their index (prompt p's
choice i: p * n + i, as OpenAI and vLLM number them), or one stream whose chunks do. Usage
counts each prompt once and every generated token. best_of > n keeps each prompt's n choices
whose sampled tokens are most likely (highest sum of logprobs)."""

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
from frontend_svc.http.prediction import add_prediction_usage
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


def _ranked(results: list[list[StreamDelta]], n: int) -> list[int]:
    """A group's choices to answer with, in order: all of them, or best_of's n most likely."""
    ranked = list(range(len(results)))
    if len(results) > n:
        ranked = sorted(ranked, key=lambda i: likelihood(results[i]), reverse=True)[:n]
    return ranked


async def serve_choices(
    ctx: HttpContext,
    request: Request,
    groups: list[list[ClientRequest]],
    formatter: Callable[[ClientRequest, int], ResponseFormatter],
    n: int,
    stream: bool,
    opts,
) -> Response:
    """`groups`: each prompt's requests (n, or best_of); `formatter(state, index)`."""
    states = [state for group in groups for state in group]
    prompt_tokens = sum(len(group[0].prompt_token_ids) for group in groups)
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
            prompt_tokens=prompt_tokens,
            stream=bool(stream),
        )
        watcher = DisconnectWatcher(request.receive)
        # streamed, a group holds n requests (best_of > n is not streamed)
        fmts = [formatter(s, p * n + i) for p, g in enumerate(groups) for i, s in enumerate(g)]
        if stream:
            streaming = True
            events = _events(ctx, states, fmts, prompt_tokens, watcher, opts)
            headers = {"X-Request-Id": states[0].request_id, "Cache-Control": "no-cache"}
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        results = await asyncio.gather(*(collect_deltas(watcher, s) for s in states))
        if any(r is None for r in results):
            return Response(status_code=CLIENT_CLOSED)
        generated = sum(r[-1].num_output_tokens for r in results if r)
        body: dict = {}
        answers: list[dict] = []
        start = 0
        for p, group in enumerate(groups):
            for rank, i in enumerate(_ranked(results[start : start + len(group)], n)):
                fmts[start + i].index = p * n + rank
                answer = fmts[start + i].response(results[start + i])  # once: logprob offsets
                body = body or answer
                answers += answer["choices"]
            start += len(group)
        body["choices"] = answers
        body["usage"] = usage(prompt_tokens, generated)
        await add_prediction_usage(body["usage"], states)
        return JSONResponse(body, headers={"X-Request-Id": states[0].request_id})
    finally:
        if not streaming:
            if watcher is not None:
                watcher.close()
            for state in submitted:
                if not state.finished:
                    ctx.scheduler.drop(state.request_id)


async def collect_deltas(
    watcher: DisconnectWatcher, state: ClientRequest, deltas: list[StreamDelta] | None = None
) -> list[StreamDelta] | None:
    """The request's deltas (after those already taken) up to its finish; None once the client
    is gone. A delta carrying an error raises it as the HTTP error it maps to."""
    deltas = [] if deltas is None else deltas
    while not deltas or deltas[-1].finish_reason is None:
        delta = await watcher.next(state)
        if delta is None:
            return None
        if delta.error:
            raise OpenAIError.from_error_code(delta.error_code, delta.error)
        deltas.append(delta)
    return deltas


async def _events(ctx, states, fmts: list[ResponseFormatter], prompt_tokens: int, watcher, opts):
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
            last = {**fmts[0].usage_chunk(0), "usage": usage(prompt_tokens, sum(generated))}
            await add_prediction_usage(last.get("usage"), states)
            yield sse(last)
        yield sse("[DONE]")
    finally:
        for task in pumps:
            task.cancel()
        watcher.close()
        for state in states:
            if not state.finished:
                ctx.scheduler.drop(state.request_id)
