"""A request as the front-end keeps it: its text so far, stop strings, pacing and the client's
stream. The scheduler side keeps its own slim record (scheduler_svc/engine/in_flight.py)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from common.convert import TokenLogprobs
from common.messages import SamplingParams
from common.outcomes import FinishReason
from frontend_svc.detokenizer import IncrementalDetokenizer


@dataclass(slots=True)
class StreamDelta:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    # vLLM's: the stop string, or the stop_token_ids entry, that ended the output; None for
    # EOS, length and anything else
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    error: str = ""
    error_code: str = ""  # a grpc.StatusCode name when the stream must end with an error status
    num_output_tokens: int = 0
    worker_id: str = ""


class DeltaStream:
    """A request's deltas for its consumer, in order, with asyncio.Queue's get / get_nowait /
    put_nowait / empty / qsize, made for the step loop's hot path: a put is an append, plus one
    future's result when a consumer is waiting (no task accounting, no events)."""

    __slots__ = ("_items", "_waiters", "_loop")

    def __init__(self) -> None:
        self._items: deque[StreamDelta] = deque()
        self._waiters: deque[asyncio.Future] = deque()
        # the consumer's loop, looked up once (asyncio.get_running_loop() costs a getpid()
        # system call, once per wake-up of every request otherwise)
        self._loop: asyncio.AbstractEventLoop | None = None

    def put_nowait(self, delta: StreamDelta) -> None:
        self._items.append(delta)
        waiters = self._waiters
        if waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
            else:  # cancelled: the next one still waiting
                self._wake_next()

    def _wake_next(self) -> None:
        """Wake the first waiter still waiting (cancelled ones are skipped)."""
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def get_nowait(self) -> StreamDelta:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    def take_merged(self, first: StreamDelta) -> StreamDelta:
        """`first` together with every delta already queued behind it, as one: a consumer that
        fell behind (a slow client, a saturated process) sends one message, not a backlog of
        one-token ones. Stops after a delta that ends the stream, and before an error (the
        tokens before it still reach the client)."""
        items = self._items
        if not items or first.finish_reason is not None or items[0].error_code:
            return first
        token_ids, texts = list(first.token_ids), [first.text]
        logprobs = list(first.logprobs) if first.logprobs is not None else None
        last = first
        while items and last.finish_reason is None and not items[0].error_code:
            last = items.popleft()
            token_ids += last.token_ids
            texts.append(last.text)
            if last.logprobs is not None:
                logprobs = (logprobs or []) + list(last.logprobs)
        return StreamDelta(
            token_ids,
            "".join(texts),
            last.finish_reason,
            last.stop_reason,
            logprobs,
            last.error,
            last.error_code,
            last.num_output_tokens,
            last.worker_id,
        )

    async def get(self) -> StreamDelta:
        items = self._items
        while not items:
            loop = self._loop
            if loop is None or loop.is_closed():
                loop = self._loop = asyncio.get_running_loop()
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                waiter.cancel()
                try:
                    self._waiters.remove(waiter)
                except ValueError:
                    pass
                if items and not waiter.cancelled():  # woken, then cancelled: pass it on
                    self._wake_next()
                raise
        return items.popleft()

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items


@dataclass(slots=True, eq=False)
class ClientRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    priority: int = 0
    tenant: str | None = None
    deadline: float | None = None
    ttft_target_s: float | None = None  # seconds from arrival to the first token, at most
    tpot_target_s: float | None = None  # mean seconds between output tokens, at most
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    queue: DeltaStream = field(default_factory=DeltaStream)
    worker_id: str | None = None
    num_migrations: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: FinishReason | None = None
    # n > 1: a sibling waits for this request's prompt to be computed (and cached), then
    # prefills only the partial last block (the scheduler parks it)
    prefill_after: str | None = None
    # --stream-interval: after the first token, tokens are streamed this many at a time (the
    # rest wait here; the last delta carries whatever waits)
    stream_interval: int = 1  # 1 for a request that asked for logprobs
    held_token_ids: list[int] = field(default_factory=list)
    held_texts: list[str] = field(default_factory=list)
    lora_name: str = ""  # the LoRA adapter the request runs with; "" = the base model

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push_tokens(
        self,
        token_ids: list[int],
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
        logprobs: list[TokenLogprobs] | None,
        now: float | None = None,
    ) -> bool:
        """Append tokens and stream them. Returns True when a stop string ended the request."""
        if self.finish_reason is not None:
            return False
        detok = self.detokenizer
        first = self.first_token_time is None
        if token_ids:
            now = time.monotonic() if now is None else now
            if first:
                self.first_token_time = now
            self.last_token_time = now
            self.output_token_ids.extend(token_ids)
        text = detok.push(token_ids, finish_reason is not None)
        stopped_by_string = detok.stop_hit is not None
        if stopped_by_string:
            finish_reason, stop_reason = FinishReason.STOP, detok.stop_hit
        else:
            stop_reason = self._stop_token(finish_reason, stop_reason)
        held = self.held_token_ids
        if finish_reason is not None:
            self.finish_reason = finish_reason
        elif not token_ids and not text:
            return False
        elif self.stream_interval > 1 and not first:  # the first tokens go at once
            released = self._hold(token_ids, text)
            if released is None:
                return False
            token_ids, text = released
            held = None
        if held:  # tokens waiting for --stream-interval go first
            token_ids, text = held + token_ids, self._take_held_text() + text
            self.held_token_ids = []
        self.queue.put_nowait(
            StreamDelta(
                token_ids,
                text,
                finish_reason,
                stop_reason,
                logprobs,
                "",
                "",
                len(self.output_token_ids),
                self.worker_id or "",
            )
        )
        return stopped_by_string

    def push_token(self, token_ids: list[int], now: float) -> bool:
        """push_tokens for the usual case (one token, the request goes on, no logprobs), the
        step loop's hot path: with the byte table and no stop strings, a lookup and a put."""
        detok = self.detokenizer
        texts = detok.texts
        if self.finish_reason is None and texts and not detok.pending and not detok.stop_strings:
            token_id = token_ids[0]
            text = texts[token_id] if 0 <= token_id < len(texts) else None
            if text is not None:
                self.last_token_time = now
                output_token_ids = self.output_token_ids
                output_token_ids.append(token_id)
                if self.first_token_time is None:
                    self.first_token_time = now
                elif self.stream_interval > 1 or self.held_token_ids:  # (interval lowered)
                    released = self._hold(token_ids, text)
                    if released is None:
                        return False
                    token_ids, text = released
                self.queue.put_nowait(
                    StreamDelta(
                        token_ids,
                        text,
                        None,
                        None,
                        None,
                        "",
                        "",
                        len(output_token_ids),
                        self.worker_id or "",
                    )
                )
                return False
        return self.push_tokens(token_ids, None, None, None, now)

    def _stop_token(self, finish_reason: FinishReason | None, wire: int | str | None) -> int | None:
        """The stop token id the scheduler reports (the wire carries the id of whichever token
        stopped the output, EOS included, as a string), as vLLM reports it: the id when it is
        one of the request's stop_token_ids, None when it is EOS."""
        if finish_reason is not FinishReason.STOP or wire is None or wire == "":
            return None
        try:
            token = int(wire)
        except ValueError:
            return None
        if token == self.eos_token_id and not self.params.ignore_eos:
            return None  # EOS is checked first, as the scheduler checks it
        return token if token in self.params.stop_token_ids else None

    def fail(self, message: str, code: str = "") -> None:
        if self.finished:
            return
        self.finish_reason = FinishReason.ERROR
        self.queue.put_nowait(
            StreamDelta(
                token_ids=self._take_held_tokens(),
                text=self._take_held_text(),
                finish_reason=FinishReason.ERROR,
                error=message,
                error_code=code,
                num_output_tokens=len(self.output_token_ids),
            )
        )

    def end_aborted(self) -> None:
        if self.finished:
            return
        self.finish_reason = FinishReason.ABORT
        self.queue.put_nowait(
            StreamDelta(
                token_ids=self._take_held_tokens(),
                text=self._take_held_text() + self.detokenizer.take_delta(True),
                finish_reason=FinishReason.ABORT,
                num_output_tokens=len(self.output_token_ids),
            )
        )

    def set_stream_interval(self, interval: int) -> None:
        """Tokens per message from now on; a request with logprobs streams each token (its
        tokens and their logprobs go together)."""
        self.stream_interval = interval if self.params.logprobs is None else 1

    def _hold(self, token_ids: list[int], text: str) -> tuple[list[int], str] | None:
        """Keep tokens back for --stream-interval; all of them once there are enough."""
        held = self.held_token_ids
        held.extend(token_ids)
        self.held_texts.append(text)
        if len(held) < self.stream_interval:
            return None
        self.held_token_ids = []
        return held, self._take_held_text()

    def _take_held_tokens(self) -> list[int]:
        held, self.held_token_ids = self.held_token_ids, []
        return held

    def _take_held_text(self) -> str:
        text = "".join(self.held_texts)
        self.held_texts = []
        return text
