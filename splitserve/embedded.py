"""The embedded mode's SchedulerClient: the front-end and the serving engine in one process,
joined without a link. The front-end code is the same as in a front-end process apart; only
this class stands where the FrontendLink client stands there.

Updates go straight from the engine's step loop into the client streams (no batching, no
protobuf), and a stop string found while detokenizing frees the request in the same step.
"""

from __future__ import annotations

import time
from typing import Any

from common.convert import TokenLogprobs
from common.outcomes import FinishReason, RequestRejected
from frontend_svc.client_request import ClientRequest
from frontend_svc.client_streams import ClientStreams
from scheduler_svc.engine.in_flight import InFlightRequest
from scheduler_svc.engine.priority_change import set_priority
from scheduler_svc.engine.serving_engine import ServingEngine
from scheduler_svc.ha import cluster_view


class EngineCounts:
    """The front-end's observer in the embedded mode: the engine's metrics already count every
    request and token; refusals before the engine are counted there too."""

    def __init__(self, engine: ServingEngine) -> None:
        self.engine = engine

    def on_request_accepted(self, state: Any) -> None: ...

    def on_request_rejected(self, reason: str) -> None:
        self.engine.observer.on_request_rejected(reason)

    def on_tokens(self, state: Any, num_new: int, now: float) -> None: ...

    def on_request_finished(self, state: Any) -> None: ...


class InProcessScheduler:
    def __init__(self, engine: ServingEngine) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.observer = EngineCounts(engine)
        self.streams = ClientStreams(self.observer, engine.pacer.interval)
        engine.pacing_listeners.append(self.streams.set_stream_interval)

    # ---- SchedulerClient ------------------------------------------------------------------
    def submit(self, state: ClientRequest) -> None:
        self.streams.add(state)
        try:
            self.engine.submit(in_flight_record(state, self))
        except RequestRejected:
            self.streams.pop(state.request_id)
            raise

    def drop(self, request_id: str) -> None:
        self.streams.pop(request_id)
        self.engine.drop(request_id)

    def abort(self, request_id: str) -> bool:
        state = self.streams.pop(request_id)
        if state is None:
            return False
        state.end_aborted()
        self.engine.drop(request_id)
        return True

    async def change_priority(self, request_id: str, priority: int) -> None:
        set_priority(self.engine, request_id, priority)

    def lora_adapters(self) -> list:
        return [cluster_view.lora_message(a) for a in self.engine.loras.describe()]

    async def load_lora_adapter(self, name: str, path: str):
        adapter = await self.engine.loras.load(name, path)
        return cluster_view.lora_message(adapter)

    async def unload_lora_adapter(self, name: str) -> int:
        return self.engine.loras.unload(name)

    def server_info(self, max_model_len: int):
        return cluster_view.server_info(self.engine, max_model_len)

    def live_workers(self) -> list[str]:
        return [s.worker_id for s in self.engine.sessions.values() if not s.lost and not s.draining]

    # ---- UpdateSink (the engine's side) ---------------------------------------------------
    def add_update(
        self,
        request_id: str,
        start: int,
        token_ids: list[int],
        finish_reason: FinishReason | None = None,
        stop_reason: str = "",
        logprobs: list[TokenLogprobs] | None = None,
        error: str = "",
        error_code: str = "",
        worker_id: str = "",
    ) -> bool:
        return self.streams.apply(
            request_id,
            start,
            token_ids,
            finish_reason,
            stop_reason,
            logprobs,
            error,
            error_code,
            worker_id,
            time.monotonic(),
        )

    def add_next_token(self, request_id: str, start: int, token_id: int) -> bool:
        return self.streams.apply_next(request_id, start, token_id, time.monotonic())


def in_flight_record(state: ClientRequest, sink: InProcessScheduler) -> InFlightRequest:
    """The engine's record of a client request of this process."""
    return InFlightRequest(
        request_id=state.request_id,
        prompt_token_ids=state.prompt_token_ids,
        params=state.params,
        sink=sink,
        priority=state.priority,
        tenant=state.tenant,
        deadline=state.deadline,
        ttft_target_s=state.ttft_target_s,
        tpot_target_s=state.tpot_target_s,
        eos_token_id=state.eos_token_id,
        arrival_time=state.arrival_time,
        output_token_ids=list(state.output_token_ids),
        num_migrations=state.num_migrations,
        prefill_after=state.prefill_after,
        lora_name=state.lora_name,
    )
