"""A worker attached to a step shard, as the leader sees it: what placement and the engine's
request bookkeeping need of a local WorkerSession, kept from its shard's reports. The requests
placed on it are the leader's own record, so its load is exact; its local queue and running set
are as of the shard's last report, which comes once per turn of the shard's loop."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from scheduler_svc.core import Request, SchedulerConfig, request_block_hashes
from scheduler_svc.core.block_pool import BlockHash


class ShardHandle(Protocol):
    """The leader's link to one shard (shard_router.ShardSession)."""

    shard_id: str

    def assign(self, worker_id: str, state: object) -> None: ...

    def cancel(self, request_id: str) -> None: ...


@dataclass(slots=True, eq=False)
class RemoteWorker:
    worker_id: str
    shard: ShardHandle
    config: SchedulerConfig  # the limits its shard holds it to (validation, placement)
    draining: bool = False
    lost: bool = False
    num_running: int = 0  # as last reported
    worst_waiting_priority: int | None = None  # in its local queue, as last reported
    kv_usage: float = 0.0
    request_ids: set[str] = field(default_factory=set)
    inflight_hashes: Counter = field(default_factory=Counter)  # prefixes on their way there
    cached: set[BlockHash] = field(default_factory=set)  # its prefix cache, as reported
    held_request_ids: set[str] = field(default_factory=set)  # rows it brought from a lost shard
    max_loras: int = 0  # LoRA adapter slots, from its registration (0 = it runs no adapters)
    resident_loras: set[str] = field(default_factory=set)  # adapters in its slots, as reported
    available_loras: set[str] = field(default_factory=set)  # adapters it has read (can run)
    # adapters of the requests placed here: in a slot by their first step, before it says so
    placed_loras: Counter = field(default_factory=Counter)

    @property
    def load(self) -> int:
        return len(self.request_ids)

    @property
    def accepting(self) -> bool:
        return not self.lost and not self.draining

    @property
    def num_local_waiting(self) -> int:
        """Placed here and not running at its shard's last report (placed since: waiting)."""
        return max(0, len(self.request_ids) - self.num_running)

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def shard_id(self) -> str:
        return self.shard.shard_id

    def cached_prefix_blocks(self, request: Request) -> int:
        """As count_prefix_blocks on the worker's own pool: leading full blocks cached there
        or on their way there, capped so that the last token is always computed."""
        if not self.config.enable_prefix_caching:
            return 0
        max_blocks = (request.num_tokens - 1) // self.config.block_size
        count = 0
        for block_hash in request_block_hashes(request, self.config.block_size, max_blocks):
            if block_hash not in self.cached and block_hash not in self.inflight_hashes:
                break
            count += 1
        return count

    def take(self, state: object, request: Request) -> list[BlockHash]:
        """Send the request to the worker's shard; its prefix is on its way there."""
        self.held_request_ids.discard(request.request_id)
        self.shard.assign(self.worker_id, state)
        if not self.config.enable_prefix_caching:
            return []
        bs = self.config.block_size
        return list(request_block_hashes(request, bs, (request.num_tokens - 1) // bs))

    def cancel(self, request_id: str) -> None:
        self.shard.cancel(request_id)

    def apply_cache_report(
        self, added: list[BlockHash], removed: list[BlockHash], reset: bool
    ) -> None:
        if reset:
            self.cached.clear()
        self.cached.difference_update(removed)
        self.cached.update(added)
