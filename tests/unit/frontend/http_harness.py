"""The OpenAI endpoints in-process for the HTTP tests: a real tokenizer, the serving engine, and
a worker that plays the model (FakeWorker's history function, or a script), with httpx and the
official openai client in front (no sockets)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import openai

from common.tokenizer import load_tokenizer
from frontend_svc.http import create_app
from frontend_svc.intake import Intake
from scheduler_svc.core import SchedulerOutput
from scheduler_svc.engine.worker_session import ExecuteTransport, StepReply
from tests.engine_fakes import (
    TOKENIZER_VOCAB,
    FakeWorker,
    http_context,
    make_engine,
    reference,
    registration,
    run_session,
)

TOK = load_tokenizer(None)
MODEL = "fake"


class ScriptedWorker(ExecuteTransport):
    """Answers each request with `reply(its prompt's token ids)`, then repeats the script's last
    token (EOS, for `says`). Keeps every prompt it was sent, decoded with special tokens."""

    def __init__(self, reply: Callable[[list[int]], list[int]]) -> None:
        self.reply = reply
        self.scripts: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}
        self.output: dict[str, list[int]] = {}
        self.prompts: list[str] = []

    async def execute(self, out: SchedulerOutput) -> StepReply:
        await asyncio.sleep(0)
        computed = {}
        for new in out.new_requests:
            rid = new.request_id
            self.scripts[rid] = self.reply(list(new.prompt_token_ids))
            self.prompt_len[rid] = len(new.prompt_token_ids)
            self.output[rid] = list(new.output_token_ids)
            self.prompts.append(TOK.decode(new.prompt_token_ids, skip_special_tokens=False))
            computed[rid] = new.num_computed_tokens
        for cached in out.cached_requests:
            computed[cached.request_id] = cached.num_computed_tokens
            if cached.resumed:
                self.output[cached.request_id] = list(cached.new_token_ids)
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            output, script = self.output[rid], self.scripts[rid]
            if computed[rid] + n >= self.prompt_len[rid] + len(output):
                token = script[min(len(output), len(script) - 1)]
                output.append(token)
                sampled[rid] = [token]
            else:
                sampled[rid] = []
        return StepReply(sampled)


def says(text: str) -> Callable[[list[int]], list[int]]:
    """A script: `text`'s tokens, then EOS."""
    script = [*TOK.encode(text, add_special_tokens=False), TOK.eos_token_id]
    return lambda prompt: script


def serve(fn, worker: ExecuteTransport | None = None, tokenizer=TOK):
    """`await fn(http, oai)` against the app: an httpx client and the official openai client
    over it. The worker: `worker`, else a FakeWorker."""
    worker = worker or FakeWorker(vocab_size=TOKENIZER_VOCAB)

    async def main():
        engine = make_engine(TOKENIZER_VOCAB)
        ctx = http_context(engine, Intake(tokenizer, MODEL, {MODEL}, 512))
        session = engine.attach(registration("w0", num_blocks=256), worker)
        task = asyncio.create_task(run_session(engine, session))
        transport = httpx.ASGITransport(app=create_app(ctx))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                oai = openai.AsyncOpenAI(
                    base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0
                )
                return await fn(http, oai)
        finally:
            session.mark_lost("test over")
            await task

    return asyncio.run(main())


def post(path: str, payload: dict, worker: ExecuteTransport | None = None, tokenizer=TOK):
    """One POST; the response."""

    async def fn(http, _):
        return await http.post(path, json=payload)

    return serve(fn, worker, tokenizer)


def sse_events(body: str) -> list:
    events = []
    for block in body.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def expected_text(prompt_ids: list[int], n: int) -> str:
    """What FakeWorker's tokens decode to (an incomplete last character is held back)."""
    return TOK.decode(reference(prompt_ids, n)).rstrip("\ufffd")
