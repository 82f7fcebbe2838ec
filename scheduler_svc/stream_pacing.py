"""How many tokens go into one streamed message (--stream-interval), fixed or adaptive.

Adaptive (`--stream-interval 0`): each token on its own while the scheduler keeps up with its
workers; while workers wait on the scheduler (the idle gap each worker reports between its
reply and the next step grows), streams go 2, 4 ... 16 tokens a message, which takes most of
the per-token cost (a delta, a wake-up, a message) off the step loop; back down once the gap
stays small. Steps up fast, down slowly, so it settles instead of swinging every period.
Only with async scheduling: without it every step waits on the scheduler by design.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_ADAPTIVE_INTERVAL = 16


@dataclass(slots=True)
class StreamPacer:
    interval: int = 1  # tokens per message after the first
    adaptive: bool = False
    high_idle_s: float = 0.001  # workers wait this long per step on average: batch more
    low_idle_s: float = 0.0003  # they wait less than this: batch less
    up_after_s: float = 0.5  # the gap must stay high this long before stepping up...
    down_after_s: float = 2.0  # ... and low this long before stepping down
    smoothing: float = 0.1  # weight of one step in the moving average of the gap
    idle_avg_s: float = 0.0
    _last_change: float | None = None

    @classmethod
    def from_setting(cls, stream_interval: int, async_scheduling: bool) -> StreamPacer:
        if stream_interval < 0:
            raise ValueError(
                f"--stream-interval must be 0 (adaptive) or more; got {stream_interval}"
            )
        if stream_interval == 0:
            return cls(interval=1, adaptive=async_scheduling)
        return cls(interval=stream_interval)

    def on_step(self, worker_idle_s: float, now: float) -> int | None:
        """One worker step's idle gap; returns the new interval when it changes."""
        if not self.adaptive:
            return None
        self.idle_avg_s += self.smoothing * (worker_idle_s - self.idle_avg_s)
        if self._last_change is None:
            self._last_change = now
        since = now - self._last_change
        interval = self.interval
        if self.idle_avg_s > self.high_idle_s and interval < MAX_ADAPTIVE_INTERVAL:
            if since < self.up_after_s:
                return None
            interval *= 2
        elif self.idle_avg_s < self.low_idle_s and interval > 1:
            if since < self.down_after_s:
                return None
            interval //= 2
        else:
            if not self.low_idle_s <= self.idle_avg_s <= self.high_idle_s:
                return None  # at a bound already
            self._last_change = now  # in the band: the clock restarts
            return None
        self.interval = interval
        self._last_change = now
        return interval
