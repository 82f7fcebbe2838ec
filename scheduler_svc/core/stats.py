"""One Scheduler's running totals, and the snapshot of them and its gauges that metrics and the
dashboard read."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scheduler_svc.core.kv_cache_manager import KVCacheManager
    from scheduler_svc.core.request import Request
    from scheduler_svc.core.speculative import SpecCounters


@dataclass(slots=True)
class SchedulerCounters:
    """Totals since start, added to by the scheduler and its helpers (SchedulerStats names)."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_shed: int = 0
    num_swap_outs: int = 0
    num_swap_ins: int = 0

    def count_computed(self, request: Request, c: int, n: int) -> None:
        """Recompute accounting when tokens [c, c + n) are scheduled: those below the request's
        high-water mark are computed again (after a preemption)."""
        hwm = request.max_computed_tokens
        if c < hwm:
            self.num_recomputed_tokens += min(c + n, hwm) - c
        if c + n > hwm:
            request.max_computed_tokens = c + n


@dataclass(slots=True)
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0  # length of the (possibly shared) waiting queue
    num_preemptions: int = 0  # total since start
    kv_usage: float = 0.0  # 1 - free/total, cached-but-free blocks counting as free
    prefix_cache_queries: int = 0  # tokens looked up at admission
    prefix_cache_hits: int = 0  # of which found in the cache
    num_recomputed_tokens: int = 0  # computed again after a preemption (prefix hits excluded)
    num_free_blocks: int = 0
    num_used_blocks: int = 0
    num_total_blocks: int = 0
    num_cached_blocks: int = 0  # blocks registered in the prefix cache (used or free)
    num_steps: int = 0  # schedule() calls
    num_prefill_tokens: int = 0  # tokens scheduled as prefill (including recomputation)
    num_decode_tokens: int = 0  # tokens scheduled as decode (one per request per step)
    num_scheduled_tokens: int = 0  # prefill + decode
    num_finished: int = 0  # finished by a stop condition or length
    num_aborted: int = 0
    num_shed: int = 0  # ended early: could no longer make their deadlines
    num_swapped: int = 0  # requests whose KV is swapped out to host blocks now
    num_swap_outs: int = 0  # preemptions that swapped (total)
    num_swap_ins: int = 0
    num_free_host_blocks: int = 0
    num_total_host_blocks: int = 0
    prefix_cache_hit_rate: float = 0.0  # hits / queries
    # speculative decoding (vLLM's spec_decode names): verifications, drafted and accepted
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)  # accepted at draft i
    spec_draft_time_s: float = 0.0  # seconds schedule() spent proposing drafts
    num_spec_lookups: int = 0  # proposals asked for (a request in a step it could draft in)
    # LoRA: requests per adapter name, running now, and waiting (queued or swapped out) here
    running_loras: dict[str, int] = field(default_factory=dict)
    waiting_loras: dict[str, int] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        if name not in _FIELD_NAMES:
            raise KeyError(name)
        return getattr(self, name)

    def keys(self) -> list[str]:
        return list(_FIELD_NAMES)

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _FIELD_NAMES}


_FIELD_NAMES = tuple(f.name for f in fields(SchedulerStats))


def collect_stats(
    counters: SchedulerCounters,
    spec: SpecCounters,
    kv: KVCacheManager,
    *,
    num_running: int,
    num_waiting: int,
    num_swapped: int,
    loras: tuple[dict[str, int], dict[str, int]],  # running_loras, waiting_loras
) -> SchedulerStats:
    pool = kv.pool
    queries = counters.prefix_cache_queries
    return SchedulerStats(
        num_running=num_running,
        num_waiting=num_waiting,
        num_preemptions=counters.num_preemptions,
        kv_usage=pool.usage,
        prefix_cache_queries=queries,
        prefix_cache_hits=counters.prefix_cache_hits,
        num_recomputed_tokens=counters.num_recomputed_tokens,
        num_free_blocks=pool.num_free_blocks,
        num_used_blocks=pool.num_used_blocks,
        num_total_blocks=pool.num_blocks,
        num_cached_blocks=len(pool.cached),
        num_steps=counters.num_steps,
        num_prefill_tokens=counters.num_prefill_tokens,
        num_decode_tokens=counters.num_decode_tokens,
        num_scheduled_tokens=counters.num_prefill_tokens + counters.num_decode_tokens,
        num_finished=counters.num_finished,
        num_aborted=counters.num_aborted,
        num_shed=counters.num_shed,
        num_swapped=num_swapped,
        num_swap_outs=counters.num_swap_outs,
        num_swap_ins=counters.num_swap_ins,
        num_free_host_blocks=kv.host_pool.num_free_blocks,
        num_total_host_blocks=kv.host_pool.num_blocks,
        prefix_cache_hit_rate=counters.prefix_cache_hits / queries if queries else 0.0,
        num_spec_drafts=spec.drafts,
        num_spec_draft_tokens=spec.draft_tokens,
        num_spec_accepted_tokens=spec.accepted_tokens,
        spec_accepted_per_pos=list(spec.accepted_per_pos),
        spec_draft_time_s=spec.draft_time_s,
        num_spec_lookups=spec.lookups,
        running_loras=loras[0],
        waiting_loras=loras[1],
    )
