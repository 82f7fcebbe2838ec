"""Builders the unit tests share: schedulers from a file's config defaults, requests with their
sampling parameters, prompts of n tokens. A test file names its defaults once:

    make = scheduler_factory(max_num_batched_tokens=16, block_size=4, num_blocks=64)
    req = functools.partial(request, max_tokens=50)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from scheduler_svc.core import Request, SamplingParams, Scheduler, SchedulerConfig


def scheduler_factory(**defaults: Any) -> Callable[..., Scheduler]:
    """A `make(**overrides)` that builds a Scheduler from `defaults` with `overrides` on top."""

    def make(**overrides: Any) -> Scheduler:
        return Scheduler(SchedulerConfig(**{**defaults, **overrides}))

    return make


def prompt(n: int, start: int = 1) -> list[int]:
    """n token ids counting up from `start` (1, 2, ..., n by default)."""
    return list(range(start, start + n))


def request(
    rid: str,
    prompt: Iterable[int],
    *,
    max_tokens: int = 16,
    priority: int = 0,
    arrival: float | None = 0.0,
    eos: int | None = None,
    tenant: str | None = None,
    deadline: float | None = None,
    out: Iterable[int] = (),
    computed: int = 0,
    **params: Any,
) -> Request:
    """A core Request; `params` are further SamplingParams fields (ignore_eos, min_tokens, ...).
    `out`: tokens generated before (as after a migration); `computed`: num_computed_tokens.
    arrival=None stamps time.monotonic() as Request does by default."""
    r = Request(
        rid,
        list(prompt),
        SamplingParams(max_tokens=max_tokens, **params),
        priority=priority,
        arrival_time=arrival,
        eos_token_id=eos,
        tenant=tenant,
        deadline=deadline,
        output_token_ids=list(out),
    )
    r.num_computed_tokens = computed
    return r
