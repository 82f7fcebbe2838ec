"""The pieces of step shards that need no process: the prefix-cache journal a shard reports, the
leader's copy of a shard worker's cache (placement reads it as a local worker's), and the
LeaderMessage a leader writes around a shard's packed updates without reading them."""

from __future__ import annotations

import asyncio
import random

from common.pb import frontend_link_pb2 as pb
from scheduler_svc.core import (
    CacheJournal,
    KVCacheManager,
    Request,
    SamplingParams,
    SchedulerConfig,
    count_prefix_blocks,
)
from scheduler_svc.links.frontend_link import FrontendSession, add_update_to
from scheduler_svc.shards.remote_worker import RemoteWorker

BLOCK = 4


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


class NoShard:
    shard_id = "s0"

    def __init__(self) -> None:
        self.assigned: list[str] = []

    def assign(self, worker_id: str, state: object) -> None:
        self.assigned.append(worker_id)

    def cancel(self, request_id: str) -> None: ...


def compute(kv: KVCacheManager, req: Request) -> bool:
    """Admit the request with its prefix hit and compute all its tokens (registering them)."""
    hits = kv.find_cached_prefix(req)
    new = kv.allocate_slots(req, req.num_tokens - len(hits) * BLOCK, hits)
    if new is None:
        return False
    req.num_computed_tokens = req.num_tokens
    return True


def test_the_journal_replayed_on_a_copy_gives_the_pool_cache_exactly():
    """Whatever a pool caches and evicts between two reports, the leader's copy after each
    report equals the pool's cache: the last change of a hash wins."""
    rng = random.Random(3)
    kv = KVCacheManager(num_blocks=24, block_size=BLOCK)
    pool = kv.pool
    pool.journal = CacheJournal(pool.cached)
    copy = RemoteWorker("w0", NoShard(), SchedulerConfig(block_size=BLOCK, num_blocks=24))
    running: list[Request] = []
    families = [[rng.randrange(100) for _ in range(12)] for _ in range(5)]
    for step in range(300):
        if running and (rng.random() < 0.4 or kv.pool.num_free_blocks < 8):
            done = running.pop(rng.randrange(len(running)))
            kv.free(done)
        else:
            tokens = rng.choice(families) + [rng.randrange(100) for _ in range(rng.randrange(9))]
            req = request(f"r{step}", tokens)
            if compute(kv, req):
                running.append(req)
                if rng.random() < 0.2:  # a step taken back: its blocks' registrations go
                    req.num_computed_tokens = BLOCK
                    kv.uncache_uncomputed(req)
        if rng.random() < 0.3:
            copy.apply_cache_report(*pool.journal.take())
            assert copy.cached == set(pool.cached)
    copy.apply_cache_report(*pool.journal.take())
    assert copy.cached == set(pool.cached)


def test_placement_reads_a_shard_worker_cache_as_a_local_one():
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK)
    assert compute(kv, request("a", list(range(40))))
    remote = RemoteWorker("w0", NoShard(), SchedulerConfig(block_size=BLOCK, num_blocks=32))
    journal = CacheJournal(kv.pool.cached)
    remote.apply_cache_report(*journal.take())
    for tokens in (list(range(40)), list(range(23)) + [99] * 10, [7] * 30, list(range(5))):
        probe = request("p", tokens)
        assert remote.cached_prefix_blocks(probe) == count_prefix_blocks(kv, probe)
    # and what was placed there but not computed yet counts as on its way
    shard = NoShard()
    remote = RemoteWorker("w1", shard, SchedulerConfig(block_size=BLOCK, num_blocks=32))
    hashes = remote.take(object(), request("b", list(range(100, 130))))
    remote.inflight_hashes.update(hashes)
    assert shard.assigned == ["w1"] and len(hashes) == 7  # (30 - 1) // 4 full blocks
    assert remote.cached_prefix_blocks(request("c", list(range(100, 120)) + [1, 2])) == 5


def test_a_relayed_batch_arrives_as_the_leader_message_the_shard_packed():
    async def main() -> tuple[object, object]:
        hello = pb.FrontendHello(frontend_id="fe0")
        session = FrontendSession(hello, lambda: 300)  # an epoch over one varint byte
        session.add_update("own", 0, [1])  # queued by the leader itself: leaves first
        batch = pb.TokenBatch()
        add_update_to(batch, "r1", 3, [5, 6], worker_id="w0")
        add_update_to(batch, "r2", 0, [], error="x", error_code="INTERNAL")
        session.relay(batch.SerializeToString())
        return session.outbox.get_nowait(), session.outbox.get_nowait()

    own, relayed = asyncio.run(main())
    assert isinstance(own, pb.LeaderMessage) and own.tokens.updates[0].request_id == "own"
    assert isinstance(relayed, bytes)
    message = pb.LeaderMessage.FromString(relayed)
    assert message.epoch == 300 and message.WhichOneof("msg") == "tokens"
    assert [(u.request_id, u.start, list(u.token_ids)) for u in message.tokens.updates] == [
        ("r1", 3, [5, 6]),
        ("r2", 0, []),
    ]
    assert message.tokens.updates[1].error_code == "INTERNAL"


def test_cluster_and_status_list_the_leaders_shards():
    from common.cluster_json import status_to_json
    from splitserve.status import render

    status = pb.ClusterStatus()
    status.server_info.model = "m"
    status.members.add(kind="scheduler", id="s", role="leader", epoch=3, state="active")
    status.members.add(
        kind="shard", id="shard-0", host="h", pid=7, state="connected", address="h:1", num_running=5
    )
    status.members.add(
        kind="worker", id="w0", state="active", num_running=5, address="shard shard-0"
    )
    body = status_to_json(status)
    assert body["shards"] == [
        {
            "id": "shard-0",
            "host": "h",
            "pid": 7,
            "state": "connected",
            "address": "h:1",
            "running": 5,
        }
    ]
    assert [w["id"] for w in body["workers"]] == ["w0"]
    assert "shard      shard-0" in render(body)
