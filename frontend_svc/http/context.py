"""What the HTTP routes share: the scheduler client, the intake, what /metrics and the dashboard
serve, and settings."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from frontend_svc.client_streams import SchedulerClient
    from frontend_svc.intake import Intake


@dataclass(slots=True)
class HttpContext:
    # None on a scheduler whose front-ends run apart: its HTTP port serves operations only
    scheduler: SchedulerClient | None
    intake: Intake | None  # None: no client API in this process
    api_key: str = ""
    metrics: CollectorRegistry | None = None  # what GET /metrics serves
    dashboard: Callable[[], dict] | None = None  # the dashboard's state (None: no dashboard)
    cluster: Callable[[], dict | None] | None = None  # GET /cluster's body (None: no leader)
    workers: Callable[[], list[str]] | None = None  # workers taking requests, for /ready
    rejected: Callable[[str], Any] = lambda reason: None  # counts a refused request
    started_at: float = field(default_factory=time.time)
    shutting_down: bool = False

    def live_workers(self) -> list[str]:
        """Ids of the workers that take new requests (attached, not lost, not draining)."""
        if self.workers is not None:
            return self.workers()
        return self.scheduler.live_workers() if self.scheduler is not None else []
