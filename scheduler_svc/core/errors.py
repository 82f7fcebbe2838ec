"""Errors the scheduler core raises, each carrying a sentence a user can act on."""

from __future__ import annotations


class RequestRejected(ValueError):
    """The request can never run as given (bad input, too long, duplicate id...).

    ``str(exc)`` is a sentence meant for the client, e.g.
    "prompt has 3000 tokens but max_model_len is 2048; shorten the prompt".
    Services map it to gRPC INVALID_ARGUMENT / HTTP 400.
    """


class SchedulerConfigError(ValueError):
    """A SchedulerConfig field is out of range or names something unknown."""
