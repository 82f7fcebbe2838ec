"""The scheduler core: pure Python, no gRPC, no torch."""

from scheduler_svc.core.outputs import (
    CachedRequestData,
    NewRequestData,
    RequestOutput,
    SchedulerOutput,
)
from scheduler_svc.core.request import FinishReason, Request, RequestStatus, SamplingParams

__all__ = [
    "CachedRequestData",
    "FinishReason",
    "NewRequestData",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "SchedulerOutput",
]
