"""SLO admission control and thrash backpressure (the checks beyond admission.py's bounds).

TTFT admission (``ttft_slo_s`` > 0): a new request's time to first token is predicted from the
work ahead of it, tokens still to prefill of the requests that would run before it (by the
queue's policy) and of running requests mid-prefill, plus its own prompt, and from measured step
times. Each worker gives prefill ``max_num_batched_tokens`` minus one token per running request
(decodes go first) per step; a step of T tokens takes ``a + b*T`` seconds, fitted online from
the steps the workers really ran. A request predicted to miss the target is refused at once
(Overloaded: RESOURCE_EXHAUSTED / HTTP 429) with a retry-after hint; before the first measured
step nothing is refused. Not modelled: a full ``max_num_seqs`` (the newcomer then also waits for
a running request to finish), prefix-cache hits.

Thrash backpressure: recomputed tokens (work done again after preemptions) over newly computed
tokens in a sliding window (default 10 s, stretched to cover at least 2048 scheduled tokens).
Above ``thrash_threshold`` (default 0.2, the seeds' 20%) the KV cache is thrashing: a warning
line is logged and the metrics say so; with ``backpressure`` on, new requests are refused until
the ratio falls below 3/4 of the threshold.
"""

from __future__ import annotations

import math
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from scheduler_svc.core.request_queue import FIFORequestQueue, KeyedRequestQueue, RequestQueue
from scheduler_svc.engine.tenant_admission import Overloaded

if TYPE_CHECKING:
    from scheduler_svc.core import Request, Scheduler, SchedulerOutput


class StepTimeModel:
    """step_s ~= a + b * tokens, least squares with exponential forgetting (recent steps count
    most). Before any step it knows nothing (``ready`` is False)."""

    def __init__(self, decay: float = 0.02) -> None:
        self.decay = decay
        self.n = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    @property
    def ready(self) -> bool:
        return self.n > 0

    def add(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        k = 1.0 - self.decay
        self._w = self._w * k + 1.0
        self._x = self._x * k + tokens
        self._y = self._y * k + seconds
        self._xx = self._xx * k + tokens * tokens
        self._xy = self._xy * k + tokens * seconds
        self.n += 1

    def coefficients(self) -> tuple[float, float]:
        """(a, b): seconds per step and per token."""
        if not self.n:
            return 0.0, 0.0
        w = self._w
        mx, my = self._x / w, self._y / w
        var = self._xx / w - mx * mx
        if var > 1e-6 * max(1.0, mx * mx):
            b = (self._xy / w - mx * my) / var
            a = my - b * mx
            if b >= 0 and a >= 0:
                return a, b
            if b < 0:
                return my, 0.0
            return 0.0, my / mx
        return 0.0, my / mx if mx > 0 else 0.0  # one step size only: proportional

    def predict(self, tokens: float) -> float:
        a, b = self.coefficients()
        return a + b * tokens


class ThrashMonitor:
    """Recomputed / newly computed tokens over a sliding time window."""

    def __init__(
        self,
        threshold: float = 0.2,
        window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        log: Any = None,
        min_tokens: int = 2048,
    ) -> None:
        self.threshold = threshold
        self.window_s = window_s
        self.min_tokens = min_tokens  # the window reaches back to cover at least this many
        self.clock = clock
        self.log = log
        self._samples: deque[tuple[float, int, int]] = deque()
        self.recomputed = 0  # in the window
        self.scheduled = 0
        self.thrashing = False
        self.num_episodes = 0
        self.first_at: float | None = None
        self.max_ratio = 0.0

    def add(self, recomputed: int, scheduled: int, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        if recomputed or scheduled:
            self._samples.append((now, recomputed, scheduled))
            self.recomputed += recomputed
            self.scheduled += scheduled
        self.update(now)

    def ratio(self, now: float | None = None) -> float:
        self._prune(self.clock() if now is None else now)
        new = self.scheduled - self.recomputed
        if new > 0:
            return self.recomputed / new
        return math.inf if self.recomputed else 0.0

    def update(self, now: float | None = None) -> bool:
        """Re-evaluate (also as time passes without steps); returns ``thrashing``."""
        now = self.clock() if now is None else now
        r = self.ratio(now)
        if math.isfinite(r) and r > self.max_ratio:
            self.max_ratio = r
        if self.threshold <= 0:
            return False
        if not self.thrashing and r > self.threshold:
            self.thrashing = True
            self.num_episodes += 1
            if self.first_at is None:
                self.first_at = now
            if self.log is not None:
                self.log.warning(
                    "kv_cache_thrashing",
                    reason=self.reason(now),
                    recompute_ratio=round(r, 3),
                    threshold=self.threshold,
                    window_s=self.window_s,
                )
        elif self.thrashing and r <= 0.75 * self.threshold:
            self.thrashing = False
            if self.log is not None:
                self.log.info("kv_cache_thrashing_over", recompute_ratio=round(r, 3))
        return self.thrashing

    def reason(self, now: float | None = None) -> str:
        r = self.ratio(now)
        pct = "all" if math.isinf(r) else f"{100 * r:.0f}%"
        return (
            f"recomputed tokens are {pct} of newly computed tokens over the last "
            f"{self.window_s:g} s (threshold {100 * self.threshold:.0f}%): preemptions are "
            "thrashing the KV cache"
        )

    def _prune(self, now: float) -> None:
        """Drop samples older than the window, but keep at least ``min_tokens`` scheduled
        tokens while they are younger than 10 windows (a slow worker's few steps are no
        evidence of thrashing, and no evidence against it)."""
        samples, horizon = self._samples, now - self.window_s
        while samples and samples[0][0] < horizon:
            t, r, s = samples[0]
            if self.scheduled - s < self.min_tokens and t >= now - 10 * self.window_s:
                break
            samples.popleft()
            self.recomputed -= r
            self.scheduled -= s


def tokens_ahead(queue: RequestQueue, request: Request, limit: float = math.inf) -> int:
    """Tokens still to compute of the requests in ``queue`` that would run before ``request``
    (stops counting past ``limit``)."""
    total = 0
    if isinstance(queue, KeyedRequestQueue):
        mine = queue.policy.key(request)
        entries: Iterable[Request] = (
            e[-1] for e in queue._index.values() if e[-1] is not None and e[0] <= mine
        )
    else:  # FIFO: everything queued is ahead; other structures: counted as ahead too
        entries = queue if isinstance(queue, FIFORequestQueue) else iter(queue)
    for r in entries:
        total += max(0, r.num_tokens - r.num_computed_tokens)
        if total > limit:
            break
    return total


class SloAdmission:
    """The engine's (and the simulator's) SLO and thrash checks; see the module docstring."""

    def __init__(
        self,
        ttft_slo_s: float = 0.0,
        thrash_threshold: float = 0.2,
        thrash_window_s: float = 10.0,
        backpressure: bool = False,
        clock: Callable[[], float] = time.monotonic,
        log: Any = None,
    ) -> None:
        self.ttft_slo_s = ttft_slo_s
        self.backpressure = backpressure
        self.clock = clock
        self.log = log
        self.steps = StepTimeModel()
        self.thrash = ThrashMonitor(thrash_threshold, thrash_window_s, clock, log)
        self._last: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.num_refused_slo = 0
        self.num_refused_thrash = 0

    @classmethod
    def from_config(cls, config: Any) -> SloAdmission:
        """From the scheduler service's configuration (--ttft-slo-ms, --thrash-*)."""
        from common.logging import get_logger

        return cls(
            ttft_slo_s=config.ttft_slo_ms / 1e3,
            thrash_threshold=config.thrash_threshold,
            thrash_window_s=config.thrash_window_s,
            backpressure=config.thrash_backpressure,
            log=get_logger("splitserve.slo"),
        )

    # -- observations -----------------------------------------------------------------------
    def on_step(self, scheduler: Scheduler, out: SchedulerOutput, step_s: float) -> None:
        """A worker finished a step; step_s: from sending it to its result. With steps
        pipelined (async scheduling) a step's period is the time since the previous result,
        when that is shorter."""
        now = self.clock()
        stats = scheduler.stats()
        recomputed, scheduled = stats.num_recomputed_tokens, stats.num_scheduled_tokens
        last_r, last_s, last_t = self._last.get(scheduler, (0, 0, -math.inf))
        self._last[scheduler] = (recomputed, scheduled, now)
        self.steps.add(out.total_num_scheduled_tokens, min(step_s, now - last_t))
        self.thrash.add(recomputed - last_r, scheduled - last_s, now)

    @property
    def paused(self) -> bool:
        """Admission paused by thrash backpressure (re-evaluated now)."""
        return self.backpressure and self.thrash.update()

    # -- the checks -------------------------------------------------------------------------
    def check(
        self, request: Request, queues: Sequence[RequestQueue], schedulers: Sequence[Scheduler]
    ) -> None:
        """Raise Overloaded when admission is paused or the TTFT target cannot be met."""
        if self.paused:
            self.num_refused_thrash += 1
            raise Overloaded(
                f"admission is paused: {self.thrash.reason()}; retry later",
                retry_after_s=max(1.0, self.thrash.window_s / 2),
            )
        slo = self.ttft_slo_s
        if slo <= 0:
            return
        predicted = self.predict_ttft(request, queues, schedulers, stop_above=slo)
        if predicted is not None and predicted > slo:
            self.num_refused_slo += 1
            raise Overloaded(
                f"the predicted time to first token (at least {predicted * 1e3:.0f} ms) is over "
                f"the target of {slo * 1e3:.0f} ms (--ttft-slo-ms): the queue ahead is too "
                "long; retry later",
                retry_after_s=min(60.0, max(0.1, predicted - slo)),
            )

    def predict_ttft(
        self,
        request: Request,
        queues: Sequence[RequestQueue],
        schedulers: Sequence[Scheduler],
        stop_above: float = math.inf,
    ) -> float | None:
        """Seconds until the request's first token, or None when nothing is measured yet (or no
        worker). Counting stops once the prediction exceeds ``stop_above``."""
        if not schedulers or not self.steps.ready:
            return None
        capacity = 0  # prefill tokens per step, all workers
        budgets = decodes = 0
        running_prefill = 0
        seen: set[int] = set()
        all_queues: list[RequestQueue] = []
        for q in queues:
            if id(q) not in seen:
                seen.add(id(q))
                all_queues.append(q)
        for s in schedulers:
            budget = s.config.max_num_batched_tokens
            budgets += budget
            d = len(s.running)
            decodes += d
            capacity += max(1, budget - d)
            for r in s.running:
                left = r.num_tokens - r.num_computed_tokens
                if left > 1:
                    running_prefill += left
            for q in (s.swapped, s.waiting):
                if id(q) not in seen:
                    seen.add(id(q))
                    all_queues.append(q)
        w = len(schedulers)
        full_step = self.steps.predict(budgets / w)
        if full_step <= 0:
            return None
        own = max(1, request.num_tokens - request.num_computed_tokens)
        limit = math.inf
        if math.isfinite(stop_above):
            limit = stop_above / full_step * capacity + 1
        ahead = running_prefill
        for q in all_queues:
            if ahead > limit:
                break
            ahead += tokens_ahead(q, request, limit - ahead)
        work = ahead + own
        if work <= capacity:  # one step, beside the running decodes
            return self.steps.predict(decodes / w + work / w)
        return work / capacity * full_step
