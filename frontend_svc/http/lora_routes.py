"""LoRA adapters at run time, in vLLM's shape, behind the API key:

    POST /v1/load_lora_adapter   {"lora_name": "sql", "lora_path": "/adapters/sql"}
    POST /v1/unload_lora_adapter {"lora_name": "sql"}

200 with a sentence; 400 when a worker refuses the files (another base model, a rank over
--max-lora-rank, files missing or corrupt: nothing stays loaded), the name is taken or no worker
serves adapters; 404 unloading an unknown adapter; 503 without a leader. The adapters are listed
in /v1/models with the base model as `parent`; a request names one as its `model`.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from common.outcomes import LoraAdapterError
from frontend_svc.http.context import HttpContext
from frontend_svc.http.errors import OpenAIError

STATUS = {
    "INVALID_ARGUMENT": 400,
    "ALREADY_EXISTS": 400,
    "FAILED_PRECONDITION": 400,
    "NOT_FOUND": 404,
    "UNAVAILABLE": 503,
}


class LoadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(max_length=128)
    lora_path: str = Field(max_length=4096)


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(max_length=128)
    lora_int_id: int | None = None  # vLLM's clients may send it; names identify adapters here


def lora_router(ctx: HttpContext) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.post("/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoraAdapter) -> str:
        try:
            await ctx.scheduler.load_lora_adapter(body.lora_name, body.lora_path)
        except LoraAdapterError as exc:
            param = "lora_path" if exc.code == "INVALID_ARGUMENT" else "lora_name"
            raise _http_error(exc, param) from None
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @router.post("/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoraAdapter) -> str:
        try:
            in_flight = await ctx.scheduler.unload_lora_adapter(body.lora_name)
        except LoraAdapterError as exc:
            raise _http_error(exc, "lora_name") from None
        finishing = f" ({in_flight} requests with it finish first)" if in_flight else ""
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully{finishing}."

    return router


def _http_error(exc: LoraAdapterError, param: str) -> OpenAIError:
    code = "model_not_found" if exc.code == "NOT_FOUND" else exc.code.lower()
    return OpenAIError(STATUS.get(exc.code, 500), str(exc), param, code)
