"""The event loop the services run on: uvloop when installed, else asyncio's own. The scheduler
wakes one stream per running request per step, so the loop's per-wakeup cost is paid thousands
of times a step; uvloop's loop, futures' callbacks and handles are C, which makes it cheaper."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def loop_factory(kind: str = "auto") -> Callable[[], asyncio.AbstractEventLoop] | None:
    """A factory for asyncio.Runner; None means asyncio's default loop."""
    if kind not in EVENT_LOOPS:
        raise ValueError(f"event loop {kind!r} is not one of {', '.join(EVENT_LOOPS)}")
    if kind == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as exc:
        if kind == "uvloop":
            raise ValueError(
                "--event-loop uvloop needs the uvloop package (pip install uvloop)"
            ) from exc
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], kind: str = "auto") -> T:
    """asyncio.run on the chosen loop."""
    with asyncio.Runner(loop_factory=loop_factory(kind)) as runner:
        return runner.run(main)


def loop_name() -> str:
    """The running loop's kind, for logs and benchmark tables."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"
