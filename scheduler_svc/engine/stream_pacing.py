"""How many tokens go into one streamed message (--stream-interval), fixed or adaptive.

Adaptive (`--stream-interval 0`): each token on its own while the scheduler keeps up with its
workers; while workers wait on the scheduler (the idle gap each worker reports between its
reply and the next step grows), streams go 2, 4 ... 16 tokens a message, which takes most of
the per-token cost (a delta, a wake-up, a message) off the step loop; back down once the gap
stays small. The gap is averaged over half-second windows; one window above the high mark
steps up, four in a row under the low mark step down, so it settles instead of swinging.
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
    low_idle_s: float = 0.0003  # they wait less than this: batch less...
    down_windows: int = 4  # ... once it held for this many windows in a row
    window_s: float = 0.5  # the gap is averaged over windows of this length
    last_idle_avg_s: float = 0.0  # the average of the last whole window
    _window_start: float | None = None
    _idle_sum: float = 0.0
    _steps: int = 0
    _low_windows: int = 0

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
        if self._window_start is None:
            self._window_start = now
        self._idle_sum += worker_idle_s
        self._steps += 1
        if now - self._window_start < self.window_s:
            return None
        avg = self.last_idle_avg_s = self._idle_sum / self._steps
        self._window_start, self._idle_sum, self._steps = now, 0.0, 0
        if avg > self.high_idle_s:
            self._low_windows = 0
            if self.interval < MAX_ADAPTIVE_INTERVAL:
                self.interval *= 2
                return self.interval
        elif avg < self.low_idle_s:
            self._low_windows += 1
            if self._low_windows >= self.down_windows and self.interval > 1:
                self._low_windows = 0
                self.interval //= 2
                return self.interval
        else:
            self._low_windows = 0
        return None
