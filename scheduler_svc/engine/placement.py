"""Which worker a waiting request goes to: the longest cached prefix, unless that worker is
much busier than the least-loaded one (then the least-loaded).

A request with a LoRA adapter goes only to a worker that runs adapters (max_loras > 0): to one
with its adapter resident, unless all such are much busier than the least-loaded; else to
one with a free adapter slot that is not much busier, so that a hot adapter spreads once its
workers are busy; else to the least-loaded (an adapter is swapped out there). Among these, a
cached prefix still counts: block hashes are seeded by the adapter, so only a prefix computed
under the same adapter is a hit."""

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
    reason: str  # prefix | least_loaded | only_worker | lora | lora_free_slot (and the engine's)
    prefix_tokens: int
    load: int


def prefix_tokens(session: WorkerSession | RemoteWorker, request: Request) -> int:
    """A local worker's cache is read in its core; a step shard's worker's from the copy its
    shard keeps up to date (the same hashes either way)."""
    return session.cached_prefix_blocks(request) * session.block_size


def runs_adapter(session: WorkerSession | RemoteWorker, request: Request) -> bool:
    """Whether the worker can run the request at all as far as adapters go: it has adapter
    slots and has read the request's adapter."""
    name = request.lora_name
    return not name or (session.max_loras > 0 and name in session.available_loras)


def much_busier(
    session: WorkerSession | RemoteWorker, least: WorkerSession | RemoteWorker, cfg: PlacementConfig
) -> bool:
    return (
        session.load - least.load > cfg.balance_abs and session.load > cfg.balance_rel * least.load
    )


def choose(
    request: Request, eligible: list[WorkerSession | RemoteWorker], cfg: PlacementConfig
) -> Placement:
    """The worker for ``request`` among ``eligible``; with an adapter, among those of them that
    run adapters (ValueError when none does: the dispatcher filters first)."""
    if request.lora_name:
        return _choose_for_adapter(request, [s for s in eligible if runs_adapter(s, request)], cfg)
    least = min(eligible, key=lambda s: s.load)
    if len(eligible) == 1:
        return Placement(least, "only_worker", prefix_tokens(least, request), least.load)
    best, best_hit = least, -1
    for session in eligible:
        hit = prefix_tokens(session, request)
        if hit > best_hit or (hit == best_hit and session.load < best.load):
            best, best_hit = session, hit
    if best_hit >= cfg.min_prefix_tokens and not much_busier(best, least, cfg):
        return Placement(best, "prefix", best_hit, best.load)
    return Placement(least, "least_loaded", prefix_tokens(least, request), least.load)


def _choose_for_adapter(
    request: Request, capable: list[WorkerSession | RemoteWorker], cfg: PlacementConfig
) -> Placement:
    if not capable:
        raise ValueError(f"no eligible worker runs LoRA adapters for {request.request_id!r}")
    least = min(capable, key=lambda s: s.load)
    if len(capable) == 1:
        return Placement(least, "only_worker", prefix_tokens(least, request), least.load)
    name = request.lora_name
    near = [s for s in capable if not much_busier(s, least, cfg)]
    # in a slot as the worker last said, or soon: a request with it was placed there (a burst
    # of a new adapter lands on one worker, not on every free slot before the reports come)
    resident = [s for s in near if name in s.resident_loras or s.placed_loras.get(name)]
    free_slot = [s for s in near if len(s.resident_loras | s.placed_loras.keys()) < s.max_loras]
    reason = "lora" if resident else "lora_free_slot" if free_slot else "least_loaded"
    hits = [(prefix_tokens(s, request), s) for s in resident or free_slot or near]
    # a prefix too short to steer for counts as none: then the least loaded of them
    hit, best = max(hits, key=lambda h: (h[0] if h[0] >= cfg.min_prefix_tokens else 0, -h[1].load))
    return Placement(best, reason, hit, best.load)


def add_inflight(session: WorkerSession | RemoteWorker, hashes: list[bytes]) -> None:
    session.inflight_hashes.update(hashes)


def remove_inflight(counter: Counter, hashes: list[bytes]) -> None:
    counter.subtract(hashes)
    for h in hashes:
        if counter[h] <= 0:
            del counter[h]
