"""FrontendLink's LoRA calls: a front-end's POST /v1/load_lora_adapter and
/v1/unload_lora_adapter reach the leader's adapter registry (engine/lora_registry.py) here."""

from __future__ import annotations

import grpc

from common.outcomes import LoraAdapterError
from common.pb import frontend_link_pb2 as pb
from scheduler_svc.ha.cluster_view import lora_message


class LoraAdapterRpcs:
    engine: object  # the ServingEngine (FrontendLinkService's)

    async def LoadLoraAdapter(self, request, context):  # noqa: N802
        try:
            adapter = await self.engine.loras.load(request.lora_name, request.lora_path)
        except LoraAdapterError as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        return lora_message(adapter)

    async def UnloadLoraAdapter(self, request, context):  # noqa: N802
        try:
            in_flight = self.engine.loras.unload(request.lora_name)
        except LoraAdapterError as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        return pb.UnloadLoraAdapterResponse(num_in_flight=in_flight)
