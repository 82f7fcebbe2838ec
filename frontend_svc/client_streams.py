"""The front-end's side of the one interface between front-end and scheduler.

The client APIs (HTTP, gRPC) talk to a `SchedulerClient`: submit, drop, abort, change a
priority, and read the cluster's state. It has two implementations: the FrontendLink client
(frontend_svc/scheduler_link.py, a front-end process apart) and the in-process one of the
embedded mode (splitserve/embedded.py). Both keep their requests in one `ClientStreams`, which
applies the scheduler's updates (token ids from a start index, a finish reason, an error) to
the client requests: detokenization, stop strings and pacing happen there, the same in both.
"""

from __future__ import annotations

from typing import Any, Protocol

from common.convert import TokenLogprobs
from common.outcomes import FinishReason, RequestRejected
from common.pb import generation_pb2 as gen_pb
from frontend_svc.client_request import ClientRequest


class StreamsObserver(Protocol):
    def on_request_accepted(self, state: Any) -> None: ...
    def on_request_rejected(self, reason: str) -> None: ...
    def on_tokens(self, state: Any, num_new: int, now: float) -> None: ...
    def on_request_finished(self, state: Any) -> None: ...


class SchedulerClient(Protocol):
    """What the client APIs need of the scheduler, wherever it runs."""

    model_name: str
    streams: ClientStreams
    observer: StreamsObserver

    def submit(self, state: ClientRequest) -> None:
        """Send a request on; raises RequestRejected when it is refused at once (an error
        update ends it later otherwise)."""
        ...

    def drop(self, request_id: str) -> None:
        """The client went away: free everything, tell nobody."""
        ...

    def abort(self, request_id: str) -> bool:
        """End the request with finish reason abort; False when it is not in flight here."""
        ...

    async def change_priority(self, request_id: str, priority: int) -> None:
        """Raises PriorityChangeError with a gRPC status name and a sentence."""
        ...

    def server_info(self, max_model_len: int) -> gen_pb.ServerInfo | None:
        """The scheduler's ServerInfo; None while no scheduler answers."""
        ...

    def lora_adapters(self) -> list[gen_pb.LoraAdapter]:
        """The LoRA adapters requests may name as their model (as last heard)."""
        ...

    async def load_lora_adapter(self, name: str, path: str) -> gen_pb.LoraAdapter:
        """Load an adapter on the workers; raises LoraAdapterError (a gRPC status name and a
        sentence)."""
        ...

    async def unload_lora_adapter(self, name: str) -> int:
        """Forget an adapter; returns the requests with it still in flight (they finish);
        raises LoraAdapterError."""
        ...

    def live_workers(self) -> list[str]:
        """Workers that take new requests (for /ready)."""
        ...


class ClientStreams:
    """The requests this front-end has in flight, each with the tokens its client already has."""

    def __init__(self, observer: StreamsObserver, stream_interval: int = 1) -> None:
        self.requests: dict[str, ClientRequest] = {}
        self.observer = observer
        self.stream_interval = stream_interval

    def add(self, state: ClientRequest) -> None:
        if state.request_id in self.requests:
            raise RequestRejected(
                f"request id {state.request_id!r} is already in flight; use a unique id"
            )
        self.requests[state.request_id] = state
        state.set_stream_interval(self.stream_interval)
        self.observer.on_request_accepted(state)

    def pop(self, request_id: str) -> ClientRequest | None:
        return self.requests.pop(request_id, None)

    def apply(
        self,
        request_id: str,
        start: int,
        token_ids: list[int],
        finish_reason: FinishReason | None,
        stop_reason: str,
        logprobs: list[TokenLogprobs] | None,
        error: str,
        error_code: str,
        worker_id: str,
        now: float,
    ) -> bool:
        """One update from the scheduler. `start` is the index of its first token, so a token
        sent twice (a resubmission after a leader change) lands once. Returns True when the
        request ended here and the scheduler still runs it (a stop string): free it there."""
        state = self.requests.get(request_id)
        if state is None:
            return False
        if error or finish_reason is FinishReason.ERROR:
            del self.requests[request_id]
            state.fail(error or "the request failed", error_code)
            self.observer.on_request_finished(state)
            return False
        have = len(state.output_token_ids)
        if start > have:  # never expected: the scheduler lost tokens this client lacks
            del self.requests[request_id]
            state.fail(f"tokens {have}..{start - 1} never arrived", "INTERNAL")
            self.observer.on_request_finished(state)
            return True
        if start < have:
            skip = have - start
            token_ids = token_ids[skip:]
            if logprobs:
                logprobs = logprobs[skip:]
        if worker_id:
            state.worker_id = worker_id
        if not token_ids and finish_reason is None:
            return False
        if finish_reason is None and not logprobs and len(token_ids) == 1:
            stopped = state.push_token(token_ids, now)
        else:
            stopped = state.push_tokens(
                token_ids, finish_reason, stop_reason or None, logprobs, now
            )
        if token_ids:
            self.observer.on_tokens(state, len(token_ids), now)
        if state.finished:
            del self.requests[request_id]
            self.observer.on_request_finished(state)
        return stopped

    def apply_next(self, request_id: str, start: int, token_id: int, now: float) -> bool:
        """apply() for the usual news, one more token of a request that goes on, in order (the
        hot path: once per request per step); anything else takes apply()."""
        state = self.requests.get(request_id)
        if state is None or start != len(state.output_token_ids):
            return self.apply(request_id, start, [token_id], None, "", None, "", "", "", now)
        stopped = state.push_token([token_id], now)
        self.observer.on_tokens(state, 1, now)
        if state.finished:
            del self.requests[request_id]
            self.observer.on_request_finished(state)
        return stopped

    def fail(self, state: ClientRequest, sentence: str, code: str) -> None:
        self.requests.pop(state.request_id, None)
        state.fail(sentence, code)
        self.observer.on_request_finished(state)

    def fail_all(self, sentence: str, code: str) -> None:
        for state in list(self.requests.values()):
            self.fail(state, sentence, code)

    def set_stream_interval(self, interval: int) -> None:
        """The scheduler's --stream-interval (adaptive: it grows while the scheduler falls
        behind its workers), for every stream from now on."""
        if interval and interval != self.stream_interval:
            self.stream_interval = interval
            for state in self.requests.values():
                state.set_stream_interval(interval)
