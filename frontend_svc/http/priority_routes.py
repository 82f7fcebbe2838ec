"""POST /v1/requests/{request_id}/priority {"priority": N}: change a waiting request's priority
(as gRPC SetPriority): 200, 404 unknown id, 409 no longer waiting, 400 bad value."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from common.outcomes import PriorityChangeError
from frontend_svc.http.context import HttpContext
from frontend_svc.http.errors import OpenAIError
from frontend_svc.http.protocol import PRIORITY

STATUS = {
    "NOT_FOUND": 404,
    "FAILED_PRECONDITION": 409,
    "INVALID_ARGUMENT": 400,
    "UNAVAILABLE": 503,
}


class PriorityChange(BaseModel):
    model_config = ConfigDict(extra="forbid")
    priority: int = Field(json_schema_extra=PRIORITY)  # the range: the scheduler's check


def priority_router(ctx: HttpContext) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.post("/requests/{request_id}/priority")
    async def change_priority(request_id: str, body: PriorityChange) -> dict:
        try:
            await ctx.scheduler.change_priority(request_id, body.priority)
        except PriorityChangeError as exc:
            raise OpenAIError(
                STATUS.get(exc.code, 500), str(exc), "priority", exc.code.lower()
            ) from None
        return {"request_id": request_id, "priority": body.priority}

    return router
