"""One request's measurements: token arrival times, TTFT, inter-token gaps, end to end."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    start: float = 0.0  # seconds since the benchmark started
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between token arrivals
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time since start, tokens)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


class _Timer:
    """Records token arrivals relative to the request's send time and the benchmark's start."""

    def __init__(self, result: RequestResult, t0: float) -> None:
        self.result = result
        self.t0 = t0
        self.sent = time.perf_counter()
        result.start = self.sent - t0
        self.last: float | None = None

    def tokens(self, n: int) -> None:
        now = time.perf_counter()
        r = self.result
        if self.last is None:
            r.ttft = now - self.sent
        else:
            r.itl.append(now - self.last)
        self.last = now
        r.arrivals.append((now - self.t0, n))

    def done(self) -> None:
        self.result.e2e = time.perf_counter() - self.sent
