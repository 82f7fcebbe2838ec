"""How a request ends and why one is refused: the types front-ends and schedulers share.

The scheduler core raises RequestRejected and ends requests with a FinishReason; the front-end
maps both to HTTP and gRPC; the FrontendLink carries them between processes. They live here so
that neither service imports the other to name them.
"""

from __future__ import annotations

import enum

PRIORITY_RANGE = (-1_000_000, 1_000_000)  # lower = more important


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id, or (front-end) a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # client cancelled or aborted
    ERROR = "error"  # failed (e.g. too many migrations)
    SHED = "shed"  # could no longer make a target: ended early (--shed-hopeless)


class RequestRejected(ValueError):
    """The request can never run as given (bad input, too long, duplicate id...).

    ``str(exc)`` is a sentence meant for the client, e.g.
    "prompt has 3000 tokens but max_model_len is 2048; shorten the prompt".
    Services map it to gRPC INVALID_ARGUMENT / HTTP 400 unless ``code`` names another status.
    """


class Overloaded(RequestRejected):
    """The server cannot take this request now; retrying later may work."""

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class PriorityChangeError(Exception):
    """Why a priority could not be changed; ``code`` is a grpc.StatusCode name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class LoraAdapterError(Exception):
    """Why a LoRA adapter could not be loaded or unloaded; ``code`` is a grpc.StatusCode name
    (INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION, UNAVAILABLE)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def error_code(exc: RequestRejected) -> str:
    """The gRPC status name a rejection maps to."""
    return getattr(exc, "code", "INVALID_ARGUMENT")
