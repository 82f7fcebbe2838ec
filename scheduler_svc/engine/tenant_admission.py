"""Admission control: a bound on the global waiting queue and per-tenant rate limits.

A refused request is refused at once with RESOURCE_EXHAUSTED (HTTP 429) and a retry-after
hint, before it costs any memory or KV blocks.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from common.outcomes import Overloaded, RequestRejected

__all__ = ["AdmissionControl", "Overloaded", "parse_tenant_seconds", "parse_tenants"]


def parse_tenants(spec: str) -> dict[str, float]:
    """ "a:10,b:1,c" -> {"a": 10.0, "b": 1.0, "c": 1.0}; empty -> {} (any tenant accepted)."""
    tenants: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, weight = item.partition(":")
        value = float(weight) if weight else 1.0
        if not name or not value > 0:
            raise ValueError(f"bad tenant {item!r} in --tenants; use name[:weight>0],...")
        tenants[name] = value
    return tenants


def parse_tenant_seconds(spec: str, flag: str) -> dict[str, float]:
    """ "a:0.5,b:2" -> {"a": 0.5, "b": 2.0}: a number of seconds > 0 per tenant."""
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, seconds = item.partition(":")
        try:
            value = float(seconds)
        except ValueError:
            value = math.nan
        if not name or not (math.isfinite(value) and value > 0):
            raise ValueError(f"bad tenant {item!r} in {flag}; use name:seconds>0,...")
        out[name] = value
    return out


@dataclass(slots=True)
class TokenBucket:
    rate: float  # refills per second
    burst: float
    tokens: float
    updated: float = field(default_factory=time.monotonic)

    def take(self, now: float) -> float:
        """0 if a token was taken, else the seconds until one will be there."""
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class AdmissionControl:
    def __init__(
        self,
        max_waiting_requests: int,
        tenant_rate: float,
        tenant_burst: int,
        tenants: dict[str, float],
    ) -> None:
        self.max_waiting_requests = max_waiting_requests
        self.tenant_rate = tenant_rate
        self.tenant_burst = max(1, tenant_burst)
        self.tenants = tenants
        self.buckets: dict[str, TokenBucket] = {}
        self.num_refused = 0

    def check(self, tenant: str | None, num_waiting: int) -> None:
        """Raise RequestRejected (unknown tenant) or Overloaded; return when admitted."""
        if self.tenants and tenant is not None and tenant not in self.tenants:
            raise RequestRejected(
                f"unknown tenant {tenant!r}; this server knows {sorted(self.tenants)}"
            )
        if self.max_waiting_requests and num_waiting >= self.max_waiting_requests:
            self.num_refused += 1
            raise Overloaded(
                f"the waiting queue is full ({num_waiting} requests, "
                f"--max-waiting-requests {self.max_waiting_requests}); retry later",
                retry_after_s=1.0,
            )
        if self.tenant_rate > 0:
            key = tenant or ""
            bucket = self.buckets.get(key)
            if bucket is None:
                bucket = self.buckets[key] = TokenBucket(
                    self.tenant_rate, self.tenant_burst, self.tenant_burst
                )
            wait = bucket.take(time.monotonic())
            if wait > 0:
                self.num_refused += 1
                raise Overloaded(
                    f"tenant {key or '(default)'!r} is over its rate limit of "
                    f"{self.tenant_rate:g} requests/s; retry in {wait:.1f} s",
                    retry_after_s=wait,
                )
