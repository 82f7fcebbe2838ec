"""Hooks the engine calls as requests and steps happen (metrics and the dashboard implement them).

The default does nothing, so the engine never depends on a metrics library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler_svc.core import SchedulerOutput
    from scheduler_svc.engine.in_flight import InFlightRequest
    from scheduler_svc.engine.worker_session import StepReply, WorkerSession


class EngineObserver:
    def on_request_accepted(self, state: InFlightRequest) -> None:
        """A request passed validation and entered the engine."""

    def on_request_rejected(self, reason: str) -> None:
        """A request was refused before entering (reason: a short kind, e.g. 'invalid')."""

    def on_tokens(self, state: InFlightRequest, num_new: int, now: float) -> None:
        """num_new output tokens reached the request's stream at time.monotonic() `now`."""

    def on_tokens_batch(self, deliveries: list[tuple[InFlightRequest, int]], now: float) -> None:
        """One step's deliveries (request, number of new tokens), all at `now`. The engine
        calls this once per step rather than on_tokens per request; the default forwards each
        to on_tokens, an observer on the hot path overrides it."""
        on_tokens = self.on_tokens
        for state, num_new in deliveries:
            on_tokens(state, num_new, now)

    def on_request_finished(self, state: InFlightRequest) -> None:
        """The request ended (state.finish_reason says how; state.finish_time when)."""

    def on_step(
        self, session: WorkerSession, out: SchedulerOutput, reply: StepReply, step_s: float
    ) -> None:
        """A worker answered one step; step_s is the scheduler-side round trip."""

    def on_worker_attached(self, session: WorkerSession) -> None: ...

    def on_worker_detached(self, session: WorkerSession, reason: str) -> None: ...


class ObserverGroup(EngineObserver):
    """Fans every hook out to several observers (metrics and the dashboard's history).
    Hooks added to EngineObserver later are forwarded too. The fan-out functions are built
    once here: hooks run per token, on the step loop's hot path."""

    def __init__(self, *observers: EngineObserver) -> None:
        self.observers = observers
        for name in dir(EngineObserver):
            if name.startswith("on_"):
                hooks = [getattr(o, name) for o in observers if not _inert(o, name)]
                setattr(self, name, _fan_out(hooks))

    def __getattr__(self, name: str):  # a hook EngineObserver does not define (yet)
        if not name.startswith("on_"):
            raise AttributeError(name)
        hook = _fan_out([getattr(o, name) for o in self.__dict__["observers"]])
        setattr(self, name, hook)
        return hook


def _inert(observer: object, name: str) -> bool:
    """Whether the observer's hook is EngineObserver's own, which does nothing (on_tokens_batch
    there only forwards to on_tokens): such hooks are left out of the fan-out."""
    cls = type(observer)
    if cls.__getattribute__ is not object.__getattribute__ or name in getattr(
        observer, "__dict__", {}
    ):
        return False  # the hook may come from anywhere
    if getattr(cls, name, None) is not getattr(EngineObserver, name, None):
        return False  # overridden (or not an EngineObserver at all)
    return name != "on_tokens_batch" or _inert(observer, "on_tokens")


def _noop(*args, **kwargs) -> None:
    return None


def _fan_out(hooks: list):
    if not hooks:
        return _noop
    if len(hooks) == 1:
        return hooks[0]

    def call(*args, **kwargs) -> None:
        for hook in hooks:
            hook(*args, **kwargs)

    return call
