"""gRPC adapter for clients: Generate (server streaming), Abort, GetServerInfo."""

from __future__ import annotations

import grpc

from common.logging import get_logger
from common.pb import generation_pb2 as pb
from common.pb import generation_pb2_grpc as pb_grpc
from scheduler_svc.admission import error_code
from scheduler_svc.core import FinishReason, RequestRejected
from scheduler_svc.engine import ServingEngine
from scheduler_svc.intake import Intake
from scheduler_svc.policy_control import PriorityChangeError
from scheduler_svc.request_state import StreamDelta

log = get_logger("splitserve.generation")

FINISH_TO_PB = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}


def delta_to_proto(request_id: str, prompt_tokens: int, delta: StreamDelta) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        request_id=request_id,
        token_ids=delta.token_ids,
        text=delta.text,
        finish_reason=FINISH_TO_PB[delta.finish_reason],
        stop_reason=delta.stop_reason,
        prompt_tokens=prompt_tokens,
        completion_tokens=delta.num_output_tokens,
        error=delta.error,
        worker_id=delta.worker_id,
    )
    for lp in delta.logprobs or ():
        entry = msg.logprobs.add(token_id=lp.token_id, logprob=lp.logprob)
        for tok, value in lp.top:
            entry.top.add(token_id=tok, logprob=value)
    return msg


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, engine: ServingEngine, intake: Intake) -> None:
        self.engine = engine
        self.intake = intake

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            state = self.intake.build(request)
            self.engine.submit(state)
        except RequestRejected as exc:
            code = error_code(exc)
            self.engine.observer.on_request_rejected(
                "overloaded" if code == "RESOURCE_EXHAUSTED" else "invalid"
            )
            retry_after = getattr(exc, "retry_after_s", None)
            if retry_after is not None:
                context.set_trailing_metadata((("retry-after", f"{retry_after:.1f}"),))
            await context.abort(getattr(grpc.StatusCode, code), str(exc))
        request_id = state.request_id
        prompt_tokens = len(state.prompt_token_ids)
        log.info(
            "request_accepted",
            request_id=request_id,
            prompt_tokens=prompt_tokens,
            max_tokens=state.params.max_tokens,
            worker_id=state.worker_id,
        )
        if request.echo_prompt_token_ids:
            yield pb.GenerateResponse(
                request_id=request_id,
                prompt_token_ids=state.prompt_token_ids,
                prompt_tokens=prompt_tokens,
            )
        try:
            while True:
                queue = state.queue
                delta: StreamDelta = queue.take_merged(await queue.get())
                if delta.error_code:
                    await context.abort(getattr(grpc.StatusCode, delta.error_code), delta.error)
                yield delta_to_proto(request_id, prompt_tokens, delta)
                if delta.finish_reason is not None:
                    log.info(
                        "request_finished",
                        request_id=request_id,
                        finish_reason=str(delta.finish_reason),
                        output_tokens=delta.num_output_tokens,
                        worker_id=delta.worker_id,
                    )
                    return
        finally:
            if not state.finished:  # client cancelled or disconnected
                log.info("request_cancelled", request_id=request_id)
                self.engine.drop(request_id)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        if not self.engine.abort(request.request_id):
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no request {request.request_id!r} is in flight"
            )
        return pb.AbortResponse()

    async def SetPriority(self, request: pb.SetPriorityRequest, context):  # noqa: N802
        try:
            await self.engine.change_priority(request.request_id, request.priority)
        except PriorityChangeError as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        log.info("priority_changed", request_id=request.request_id, priority=request.priority)
        return pb.SetPriorityResponse()

    async def GetServerInfo(self, request, context):  # noqa: N802
        info = self.engine.server_info(self.intake.max_model_len)
        if info is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "no scheduler leader is connected; retry later"
            )
        return info
