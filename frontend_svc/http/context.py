"""What the HTTP routes share: the engine, the intake, observers and settings."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler_svc.dashboard.history import DashboardHistory
    from scheduler_svc.engine import ServingEngine
    from scheduler_svc.intake import Intake
    from scheduler_svc.metrics import MetricsObserver


@dataclass(slots=True)
class HttpContext:
    engine: ServingEngine
    intake: Intake | None  # None: no client API in this process
    api_key: str = ""
    metrics: MetricsObserver | None = None
    history: DashboardHistory | None = None
    cluster: Callable[[], dict | None] | None = None  # GET /cluster's body (None: no leader)
    started_at: float = field(default_factory=time.time)
    shutting_down: bool = False

    def live_workers(self) -> list:
        """Sessions that take new requests (attached, not lost, not draining)."""
        return [
            s
            for s in self.engine.sessions.values()
            if not s.lost and not getattr(s, "draining", False)
        ]
