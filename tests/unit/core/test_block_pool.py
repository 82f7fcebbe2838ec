"""Block pool, free queue (LRU) and KV cache manager (prefix lookup, allocation, caching)."""

from __future__ import annotations

import functools

import pytest

from scheduler_svc.core import (
    BlockPool,
    FreeBlockQueue,
    KVCacheBlock,
    KVCacheManager,
    hash_block_tokens,
)
from tests.factories import request


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_o1_ops_and_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert ids(q) == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4]
    assert q.popleft() is blocks[0]
    q.append(blocks[0])
    q.appendleft(blocks[2])
    assert ids(q) == [2, 1, 3, 4, 0] and q.num_free == 5
    with pytest.raises(ValueError):
        q.remove(KVCacheBlock(9))
    for _ in range(5):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


def test_hash_is_chained_and_content_addressed():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    other_parent = hash_block_tokens(None, [9, 9, 9, 9])
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(other_parent, [5, 6, 7, 8])


def test_pool_accounting_and_lru_eviction_of_cached_blocks():
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert ids(a) == [0, 1] and ids(b) == [2, 3]
    assert pool.num_free_blocks == 2 and pool.num_used_blocks == 4 and pool.usage == 4 / 6
    for i, blk in enumerate(a + b):
        assert pool.cache_block(blk, bytes([i]) * 32)
    pool.free(reversed(a))  # a finished first: tail block first
    pool.free(reversed(b))
    pool.check_invariants()
    assert pool.usage == 0.0  # cached-but-free counts as free
    assert ids(pool.free_queue) == [4, 5, 1, 0, 3, 2]
    got = pool.allocate(4)  # the empty ones first, then the least recently freed cached ones
    assert ids(got) == [4, 5, 1, 0]
    assert got[2].block_hash is None and len(pool.cached) == 2
    pool.check_invariants()


def test_uncached_free_blocks_go_to_the_head():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.cache_block(blocks[0], b"x" * 32)
    pool.free(reversed(blocks))
    assert ids(pool.free_queue) == [1, 2, 3, 0]  # the cached one is evicted last


def test_touch_revives_cached_free_block_and_ref_counts():
    pool = BlockPool(3)
    (blk,) = pool.allocate(1)
    pool.cache_block(blk, b"h" * 32)
    pool.free([blk])
    assert pool.num_free_blocks == 3
    pool.touch([blk])
    pool.touch([blk])
    assert blk.ref_cnt == 2 and pool.num_free_blocks == 2
    pool.free([blk])
    assert pool.num_free_blocks == 2
    pool.free([blk])
    assert pool.num_free_blocks == 3 and pool.lookup(b"h" * 32) is blk
    pool.check_invariants()
    with pytest.raises(AssertionError):
        pool.free([blk])


def test_duplicate_content_is_not_registered_twice():
    pool = BlockPool(2)
    x, y = pool.allocate(2)
    assert pool.cache_block(x, b"d" * 32)
    assert not pool.cache_block(y, b"d" * 32)
    assert y.block_hash is None


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2)
    (x,) = pool.allocate(1)
    pool.cache_block(x, b"d" * 32)
    assert not pool.reset_prefix_cache()
    pool.free([x])
    assert pool.reset_prefix_cache() and not pool.cached and x.block_hash is None


_req = functools.partial(request, arrival=None)  # arrival: time.monotonic(), Request's default


def test_manager_allocates_only_on_block_boundaries():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = _req("a", range(5))
    assert ids(kv.allocate_slots(r, 5)) == [0, 1]
    r.num_computed_tokens = 5
    r.output_token_ids.append(9)
    assert kv.allocate_slots(r, 1) == ()  # position 5 in block 1
    r.num_computed_tokens = 6
    r.output_token_ids += [9, 9]
    assert kv.allocate_slots(r, 2) == ()  # positions 6, 7
    r.num_computed_tokens = 8
    r.output_token_ids.append(9)
    assert ids(kv.allocate_slots(r, 1)) == [2]
    assert kv.block_ids("a") == [0, 1, 2]


def test_manager_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = _req("a", range(8))
    kv.allocate_slots(a, 8)
    b = _req("b", range(100, 108))
    assert kv.allocate_slots(b, 8) is None
    assert kv.num_free_blocks == 1 and "b" not in kv.req_blocks
    assert kv.allocate_slots(_req("c", [1]), 1, reserve_blocks=1) is None
    assert ids(kv.allocate_slots(_req("d", [1]), 1)) == [2]


def test_manager_prefix_lookup_register_and_cap():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = _req("a", range(10))
    assert kv.find_cached_prefix(_req("x", range(10))) == []
    kv.allocate_slots(a, 10)  # the step computing 0..9 fills blocks 0 and 1: registered now
    a.num_computed_tokens = 10
    assert len(kv.pool.cached) == 2
    b = _req("b", list(range(8)) + [42, 43])
    hits = kv.find_cached_prefix(b)
    assert ids(hits) == [0, 1]
    c = _req("c", range(8))  # hit capped at (8 - 1) // 4 = 1 block
    assert ids(kv.find_cached_prefix(c)) == [0]
    d = _req("d", [0, 1, 2, 3, 4, 5, 6, 99, 8])  # second block differs
    assert ids(kv.find_cached_prefix(d)) == [0]
    # prompt + output tokens hash the same as the same tokens all in the prompt
    e = _req("e", [0, 1, 2], out=[3, 4, 5, 6, 7, 1])
    assert ids(kv.find_cached_prefix(e)) == [0, 1]
    new = kv.allocate_slots(b, 2, hits)
    assert ids(new) == [3] and [blk.ref_cnt for blk in hits] == [2, 2]
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 16 and kv.usage == 0.0
    kv.pool.check_invariants()


def test_manager_hit_on_cached_free_blocks_counts_them_against_free():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = _req("a", range(8))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.free(a)
    b = _req("b", list(range(8)) + [1, 2, 3, 4, 5])  # 2 hits + needs 2 more blocks; 3 total
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 2
    assert kv.allocate_slots(b, 5, hits) is None  # reviving 2 + 2 new > 3 free
    assert kv.allocate_slots(b, 4, hits) is not None  # 2 + 1 fits
    kv.pool.check_invariants()


def test_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = _req("a", range(8))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a, 8)
    assert not kv.pool.cached and kv.find_cached_prefix(_req("b", range(12))) == []


def test_blocks_filled_during_decode_are_registered_and_taken_back_ones_dropped():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", range(6))
    kv.allocate_slots(a, 6)  # fills block 0 only
    assert len(kv.pool.cached) == 1
    a.num_computed_tokens = 6
    a.output_token_ids += [7, 8]
    kv.cache_full_blocks(a, 8)  # the decode step computing position 7 fills block 1
    assert len(kv.pool.cached) == 2
    a.num_computed_tokens = 7  # ... but that step was taken back (preempted in schedule())
    kv.uncache_uncomputed(a)
    assert len(kv.pool.cached) == 1 and kv.req_blocks["a"][1].block_hash is None
    kv.free(a)
    kv.pool.check_invariants()
