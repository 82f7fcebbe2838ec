"""Which worker a waiting request goes to: the longest cached prefix, unless that worker is
much busier than the least-loaded one (then the least-loaded)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler_svc.core import Request

if TYPE_CHECKING:
    from scheduler_svc.engine.worker_session import WorkerSession
    from scheduler_svc.shards.remote_worker import RemoteWorker


@dataclass(slots=True)
class PlacementConfig:
    min_prefix_tokens: int = 16  # a shorter shared prefix is not worth steering for
    balance_abs: int = 8  # "much busier": more than this many requests above the least loaded
    balance_rel: float = 2.0  # ... and more than this factor above it


@dataclass(slots=True)
class Placement:
    session: WorkerSession | RemoteWorker
    reason: str  # prefix | least_loaded | only_worker
    prefix_tokens: int
    load: int


def prefix_tokens(session: WorkerSession | RemoteWorker, request: Request) -> int:
    """A local worker's cache is read in its core; a step shard's worker's from the copy its
    shard keeps up to date (the same hashes either way)."""
    return session.cached_prefix_blocks(request) * session.block_size


def choose(
    request: Request, eligible: list[WorkerSession | RemoteWorker], cfg: PlacementConfig
) -> Placement:
    least = min(eligible, key=lambda s: s.load)
    if len(eligible) == 1:
        return Placement(least, "only_worker", prefix_tokens(least, request), least.load)
    best, best_hit = least, -1
    for session in eligible:
        hit = prefix_tokens(session, request)
        if hit > best_hit or (hit == best_hit and session.load < best.load):
            best, best_hit = session, hit
    much_busier = (
        best.load - least.load > cfg.balance_abs and best.load > cfg.balance_rel * least.load
    )
    if best_hit >= cfg.min_prefix_tokens and not much_busier:
        return Placement(best, "prefix", best_hit, best.load)
    return Placement(least, "least_loaded", prefix_tokens(least, request), least.load)


def add_inflight(session: WorkerSession | RemoteWorker, hashes: list[bytes]) -> None:
    session.inflight_hashes.update(hashes)


def remove_inflight(counter: Counter, hashes: list[bytes]) -> None:
    counter.subtract(hashes)
    for h in hashes:
        if counter[h] <= 0:
            del counter[h]
