"""The KV block pool: fixed blocks, ref counts, an LRU free queue and the prefix-cache map.

Every one of the ``num_blocks`` blocks is usable. A block is either used (ref_cnt > 0) or in the
free queue (ref_cnt == 0), so free + used == total always. A free block may still hold a cached
full block of KV (it keeps its hash) until it is handed out again: such "cached-but-free" blocks
count as free and are evicted least recently freed first. Free blocks without a hash are put at
the head of the queue (nothing to lose), so cached blocks are only evicted when no empty block is
left.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of a FULL block: sha256(parent hash || the block's token ids as int64)."""
    h = hashlib.sha256(parent if parent is not None else b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set while the block is registered in the prefix cache
    prev_free: KVCacheBlock | None = None  # free-queue links (None when not in the queue)
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = " cached" if self.block_hash is not None else ""
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels: O(1) popleft, append, remove."""

    __slots__ = ("_head", "_tail", "num_free")

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free KV blocks")
        self._unlink(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None:
            raise ValueError(f"{block!r} is not in the free queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        block.prev_free = last
        block.next_free = self._tail
        last.next_free = block
        self._tail.prev_free = block
        self.num_free += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self._head.next_free
        assert first is not None
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self._head.next_free = block
        self.num_free += 1

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        # a queued block always has both neighbours (the sentinels bound the list); callers
        # check membership, so this hot path does not test for None again
        prev.next_free = nxt  # type: ignore[union-attr]
        nxt.prev_free = prev  # type: ignore[union-attr]
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Head (evicted first) to tail."""
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free


class CacheJournal:
    """The prefix cache's changes since the last take(): what a step shard reports to the leader,
    which keeps a copy of each worker's cached hashes for placement. The last change of a hash
    wins, so the copy ends up exact whatever happened in between."""

    __slots__ = ("added", "removed", "reset")

    def __init__(self, cached: Iterable[BlockHash] = ()) -> None:
        self.added: set[BlockHash] = set(cached)
        self.removed: set[BlockHash] = set()
        self.reset = True  # the first report is the whole cache

    def add(self, block_hash: BlockHash) -> None:
        self.removed.discard(block_hash)
        self.added.add(block_hash)

    def evict(self, block_hash: BlockHash) -> None:
        self.added.discard(block_hash)
        self.removed.add(block_hash)

    def clear(self) -> None:
        self.added.clear()
        self.removed.clear()
        self.reset = True

    def take(self) -> tuple[list[BlockHash], list[BlockHash], bool]:
        """(added, removed, reset) since the last take; empties the journal."""
        taken = (list(self.added), list(self.removed), self.reset)
        self.added.clear()
        self.removed.clear()
        self.reset = False
        return taken


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.journal: CacheJournal | None = None  # kept on a step shard only

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, cached-but-free ones included."""
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    @property
    def usage(self) -> float:
        """1 - free/total (cached-but-free blocks are free), computed as used/total."""
        return (self.num_blocks - self.free_queue.num_free) / self.num_blocks

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Hand out n free blocks (head first), evicting their cached content."""
        if n > self.free_queue.num_free:
            raise ValueError(f"asked for {n} blocks but only {self.free_queue.num_free} are free")
        popleft = self.free_queue.popleft
        cached = self.cached
        out = []
        for _ in range(n):
            block = popleft()
            h = block.block_hash
            if h is not None:
                if cached.get(h) is block:
                    del cached[h]
                    if self.journal is not None:
                        self.journal.evict(h)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A prefix-cache hit: take the blocks out of the free queue if needed, ref++."""
        remove = self.free_queue.remove
        for block in blocks:
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def claim(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take these very blocks (a new leader adopting what a worker holds): a free one
        leaves the free queue and its prefix-cache entry, since it holds the worker's KV now,
        not what this pool last cached in it; ref++."""
        remove = self.free_queue.remove
        for block in blocks:
            if block.ref_cnt == 0:
                remove(block)
                self.uncache(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """ref--; blocks reaching 0 join the free queue in the given order (first = evicted
        first among the cached ones). Callers pass a request's blocks in reverse."""
        queue = self.free_queue
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    queue.appendleft(block)
                else:
                    queue.append(block)
            elif block.ref_cnt < 0:
                raise AssertionError(f"{block!r} freed more often than it was taken")

    def uncache(self, block: KVCacheBlock) -> None:
        """Take the block's content out of the prefix cache (it will not hold it)."""
        h = block.block_hash
        if h is not None:
            if self.cached.get(h) is block:
                del self.cached[h]
                if self.journal is not None:
                    self.journal.evict(h)
            block.block_hash = None

    def lookup(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a full, computed block under its hash. False if that content is already
        cached in another block (this one then stays unregistered)."""
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self.journal is not None:
            self.journal.add(block_hash)
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Only when no block is in use (returns False otherwise)."""
        if self.num_used_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        if self.journal is not None:
            self.journal.clear()
        return True

    def check_invariants(self) -> None:
        """O(num_blocks) consistency check for tests; raises AssertionError."""
        in_queue = list(self.free_queue)
        assert len(in_queue) == self.free_queue.num_free, "free count drifted"
        assert len({id(b) for b in in_queue}) == len(in_queue), "block twice in free queue"
        for block in in_queue:
            assert block.ref_cnt == 0, f"{block!r} in free queue with refs"
        used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert used + len(in_queue) == self.num_blocks, "free + used != total"
        for h, block in self.cached.items():
            assert block.block_hash == h, f"{block!r} cached under a stale hash"


class HostBlockPool:
    """Host (CPU) blocks that hold swapped-out KV: plain ids, no caching, O(1) take/give."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"asked for {n} host blocks but only {len(self._free)} are free")
        pop = self._free.pop
        return [pop() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(reversed(block_ids))
