"""The serving engine's test doubles and builders: a fake worker that plays the model runner
(the next token is a function of the whole history), engines, request states, registrations."""

from __future__ import annotations

import asyncio

from frontend_svc.client_request import ClientRequest
from frontend_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.core import SamplingParams, SchedulerOutput
from scheduler_svc.engine.in_flight import InFlightRequest
from scheduler_svc.engine.serving_engine import ServingEngine
from scheduler_svc.engine.worker_session import (
    ExecuteTransport,
    StepReply,
    WorkerLost,
    WorkerRegistration,
)
from splitserve.embedded import InProcessScheduler, in_flight_record

VOCAB = 1000  # the fake model's; tests that tokenize real text give the engine TOKENIZER_VOCAB
TOKENIZER_VOCAB = 49152  # the default model's (SmolLM2), whose tokenizer those tests use


def next_token(history: list[int]) -> int:
    h = 17
    for t in history[-8:]:
        h = (h * 31 + t) % 1_000_003
    return 3 + h % (VOCAB - 3)


def reference(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


class FakeDecoder:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{t}>" for t in ids)


class FakeWorker(ExecuteTransport):
    """Plays the model runner: the next token is a function of the whole history. Like a real
    model's embedding lookup, a step fails as a whole when any token id it is sent is outside
    the vocabulary."""

    def __init__(self, fail_at_step: int | None = None, vocab_size: int = VOCAB) -> None:
        self.vocab_size = vocab_size
        self.prompts: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.steps = 0
        self.fail_at_step = fail_at_step

    async def execute(self, out: SchedulerOutput) -> StepReply:
        await asyncio.sleep(0)
        self.steps += 1
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            raise WorkerLost("fake worker died")
        for rid in out.finished_req_ids:
            self.tokens.pop(rid, None)
            self.prompts.pop(rid, None)
        computed = {}
        for new in out.new_requests:
            if max(new.prompt_token_ids + new.output_token_ids) >= self.vocab_size:
                raise WorkerLost(
                    f"worker failed a step: token id out of range for {new.request_id}"
                )
            self.prompts[new.request_id] = list(new.prompt_token_ids)
            self.tokens[new.request_id] = new.prompt_token_ids + new.output_token_ids
            computed[new.request_id] = new.num_computed_tokens
        for cached in out.cached_requests:
            computed[cached.request_id] = cached.num_computed_tokens
            if cached.resumed:  # all output tokens so far are re-sent on resume
                self.tokens[cached.request_id] = (
                    self.prompts[cached.request_id] + cached.new_token_ids
                )
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            seq = self.tokens[rid]
            if computed[rid] + n >= len(seq):
                tok = next_token(seq)
                seq.append(tok)
                sampled[rid] = [tok]
            else:
                sampled[rid] = []
        return StepReply(sampled)


class EmbeddedEngine(ServingEngine):
    """The engine with the embedded mode's front-end in front of it (splitserve/embedded.py):
    tests submit client requests and read their streams, as the client APIs do."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.client = InProcessScheduler(self)
        self.records: dict[str, InFlightRequest] = {}  # every request's, ended ones too

    def submit(self, state: ClientRequest | InFlightRequest) -> None:
        if isinstance(state, ClientRequest):
            self.client.submit(state)
        else:
            super().submit(state)
            self.records[state.request_id] = state

    def resume_client(self, states: list[ClientRequest]) -> int:
        """As a front-end's hello resumes its requests: in its streams and in the engine."""
        records = []
        for state in states:
            self.client.streams.add(state)
            records.append(in_flight_record(state, self.client))
            self.records[state.request_id] = records[-1]
        return self.resume(records)

    def record(self, state: ClientRequest) -> InFlightRequest:
        """The engine's record of a client request: where it runs, how often it moved."""
        return self.records[state.request_id]


def make_engine(vocab_size: int = VOCAB, **overrides) -> EmbeddedEngine:
    defaults = dict(
        max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512, worker_wait_timeout=0.5
    )
    cfg = SchedulerServiceConfig(**{**defaults, **overrides})
    return EmbeddedEngine(cfg, "fake", vocab_size)


def make_state(rid: str, prompt: list[int], max_tokens: int, stop=()) -> ClientRequest:
    return ClientRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        detokenizer=IncrementalDetokenizer.for_prompt(FakeDecoder(), prompt, True, list(stop)),
    )


def registration(wid: str, num_blocks: int = 64) -> WorkerRegistration:
    return WorkerRegistration(
        wid,
        "fake",
        block_size=4,
        num_device_blocks=num_blocks,
        num_host_blocks=0,
        max_model_len=512,
    )


async def drain(state: ClientRequest) -> tuple[list[int], list]:
    tokens, deltas = [], []
    while True:
        delta = await asyncio.wait_for(state.queue.get(), 10)
        deltas.append(delta)
        tokens.extend(delta.token_ids)
        if delta.finish_reason is not None:
            return tokens, deltas


async def submit_and_drain(engine, states: list[ClientRequest]) -> list[tuple[list[int], list]]:
    for s in states:
        engine.submit(s)
    return await asyncio.gather(*(drain(s) for s in states))


async def run_session(engine, session):
    await engine.run_worker(session)
    engine.detach(session, session.lost_reason or "test")


def http_context(
    engine: EmbeddedEngine, intake=None, api_key: str = "", metrics=None, history=None, **kw
):
    """The HTTP routes' context in front of a test engine, as the embedded mode builds it."""
    from frontend_svc.http import HttpContext

    return HttpContext(
        engine.client,
        intake,
        api_key,
        metrics.registry if metrics is not None else None,
        dashboard=history.snapshot if history is not None else None,
        rejected=engine.client.observer.on_request_rejected,
        **kw,
    )
