"""Per-request KV block tables on top of the BlockPool: prefix lookup, allocation, caching, free.

Token positions [i * block_size, (i + 1) * block_size) of a request live in its i-th block. A
block is registered in the prefix cache, under the chained hash of its tokens, as soon as a step
that FILLS it is scheduled (as vLLM does): the worker writes every scheduled token's K/V into the
cache before any attention of that layer reads it, so a request admitted later in the same step
can already reuse it. If that step is taken back (its request preempted within the same
schedule()), uncache_uncomputed() drops those registrations again. A prefix hit is capped so that
the last known token is always computed (the model must run on at least one token to sample).
"""

from __future__ import annotations

import hashlib
from collections.abc import Container, Sequence

from scheduler_svc.core.block_pool import (
    BlockHash,
    BlockPool,
    HostBlockPool,
    KVCacheBlock,
    hash_block_tokens,
)
from scheduler_svc.core.request import Request

_NO_BLOCKS: tuple[KVCacheBlock, ...] = ()


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
    ):
        self.block_size = block_size
        self.enable_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.host_pool = HostBlockPool(num_host_blocks)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_host_blocks: dict[str, list[int]] = {}  # swapped-out requests' host tables
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks registered in the cache
        # adoption (a new leader taking over a worker's rows): per adopted request how many
        # leading blocks of its table it adopted, and per adopted block how many requests did
        self._adopted: dict[str, int] = {}
        self._adopted_refs: dict[int, int] = {}

    # -- queries ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def num_blocks_of(self, request_id: str) -> int:
        return len(self.req_blocks.get(request_id, ()))

    # -- prefix cache -----------------------------------------------------------------------
    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        return request_block_hashes(request, self.block_size, num_blocks)

    def find_cached_prefix(self, request: Request) -> list[KVCacheBlock]:
        """Cached blocks holding the request's longest prefix of full blocks, at most
        (num_tokens - 1) // block_size of them. Touches nothing."""
        if not self.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        if max_blocks <= 0:
            return hits
        lookup = self.pool.cached.get
        hashes = request.block_hashes if request.block_hashes_block_size == self.block_size else []
        for i in range(max_blocks):
            if i >= len(hashes):
                hashes = self.block_hashes(request, min(max_blocks, i + 8))
            block = lookup(hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full within its first ``num_tokens`` tokens
        (computed, or being computed in the step just scheduled)."""
        if not self.enable_caching:
            return
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if not blocks:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        num_full = min(num_full, len(blocks))
        start = self._num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        hashes = self.block_hashes(request, num_full)
        cache_block = self.pool.cache_block
        for i in range(start, num_full):
            cache_block(blocks[i], hashes[i])
        self._num_cached_blocks[rid] = num_full

    def uncache_uncomputed(self, request: Request) -> None:
        """Drop the registrations of the request's blocks beyond its num_computed_tokens: a step
        that would have filled them was taken back, so their KV will never be written."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        keep = request.num_computed_tokens // self.block_size
        num_cached = self._num_cached_blocks.get(rid, 0)
        if not blocks or num_cached <= keep:
            return
        uncache = self.pool.uncache
        for block in blocks[keep:num_cached]:  # its own blocks: hits never reach this far
            uncache(block)
        self._num_cached_blocks[rid] = keep

    # -- allocation -------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = _NO_BLOCKS,
        reserve_blocks: int = 0,
    ) -> Sequence[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the request's computed ones
        (plus ``new_computed_blocks``, a prefix hit at admission). Returns the newly allocated
        blocks (often empty), or None, changing nothing, when the pool cannot provide them while
        keeping ``reserve_blocks`` free."""
        bs = self.block_size
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        have = len(blocks) if blocks is not None else 0
        num_hit = len(new_computed_blocks)
        need_tokens = request.num_computed_tokens + num_hit * bs + num_new_tokens
        num_new = -(-need_tokens // bs) - have - num_hit
        if num_new <= 0 and not num_hit:
            if blocks is None:
                self.req_blocks[rid] = []
            elif self.enable_caching:
                self.cache_full_blocks(request, need_tokens)
            return _NO_BLOCKS
        num_new = max(num_new, 0)
        pool = self.pool
        num_revived = 0
        for block in new_computed_blocks:
            if block.ref_cnt == 0:
                num_revived += 1
        if num_new + num_revived + reserve_blocks > pool.free_queue.num_free:
            return None
        if blocks is None:
            blocks = self.req_blocks[rid] = []
        if num_hit:
            pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            if have == 0:
                self._num_cached_blocks[rid] = num_hit
        new_blocks = pool.allocate(num_new) if num_new else _NO_BLOCKS
        blocks.extend(new_blocks)
        if self.enable_caching:
            self.cache_full_blocks(request, need_tokens)
        return new_blocks

    def trim(self, request: Request) -> None:
        """Give back the request's blocks past its computed tokens (a step's drafted slots that
        verification rejected), so it holds ceil(num_computed_tokens / block_size) again."""
        blocks = self.req_blocks.get(request.request_id)
        keep = -(-request.num_computed_tokens // self.block_size)
        if not blocks or len(blocks) <= keep:
            return
        self.uncache_uncomputed(request)
        tail = blocks[keep:]
        del blocks[keep:]
        self.pool.free(reversed(tail))

    def free(self, request: Request) -> None:
        """Give back all of the request's blocks, the tail of the sequence first (so it is
        evicted first); full computed blocks stay in the prefix cache."""
        rid = request.request_id
        self._num_cached_blocks.pop(rid, None)
        blocks = self.req_blocks.pop(rid, None)
        if self._adopted and blocks is not None:
            self._forget_adopted(rid, blocks)
        if blocks:
            self.pool.free(reversed(blocks))

    # -- adoption ---------------------------------------------------------------------------
    def adopt(self, request: Request, block_ids: Sequence[int], num_blocks: int) -> None:
        """Hold the first ``num_blocks`` of ``block_ids`` for a request whose KV a worker
        already holds there (a new leader taking over). A block another adopted request holds
        is shared (ref++), as a prefix hit would share it. The blocks get no prefix-cache
        hashes: they become cacheable only when recomputed. Raises ValueError, changing
        nothing, for an id outside the pool or twice in the table, or a block in use by a
        request this pool placed itself."""
        rid = request.request_id
        if rid in self.req_blocks or rid in self.req_host_blocks:
            raise ValueError(f"request {rid!r} already holds blocks here; adopt it only once")
        pool = self.pool
        for b in block_ids:
            if not 0 <= b < pool.num_blocks:
                raise ValueError(
                    f"block id {b} of request {rid!r} is outside this worker's pool of "
                    f"{pool.num_blocks} blocks"
                )
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"request {rid!r} names a block twice in its table {block_ids}")
        taken = [pool.blocks[b] for b in block_ids[:num_blocks]]
        refs = self._adopted_refs
        for block in taken:
            if block.ref_cnt and not refs.get(block.block_id):
                raise ValueError(
                    f"block {block.block_id} of request {rid!r} is in use by a request this "
                    "scheduler placed itself; a worker's table cannot claim it"
                )
        pool.claim(taken)
        for block in taken:
            refs[block.block_id] = refs.get(block.block_id, 0) + 1
        self.req_blocks[rid] = taken
        self._num_cached_blocks[rid] = len(taken)  # not registered: no hashes for them
        self._adopted[rid] = len(taken)

    def _forget_adopted(self, rid: str, blocks: list[KVCacheBlock]) -> None:
        num = self._adopted.pop(rid, 0)
        refs = self._adopted_refs
        for block in blocks[:num]:
            left = refs[block.block_id] - 1
            if left:
                refs[block.block_id] = left
            else:
                del refs[block.block_id]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    # -- swap -------------------------------------------------------------------------------
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the blocks holding the request's computed KV to host blocks and free its device
        blocks (full ones stay in the prefix cache). Returns the (device, host) pairs the worker
        copies before this step's forward, or None (nothing changed) when the host is full."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid, [])
        keep = min(-(-request.num_computed_tokens // self.block_size), len(blocks))
        if keep > self.host_pool.num_free_blocks:
            return None
        host_ids = self.host_pool.allocate(keep)
        self.req_host_blocks[rid] = host_ids
        pairs = [(blocks[i].block_id, host_ids[i]) for i in range(keep)]
        self.free(request)
        return pairs

    def swap_in(
        self, request: Request, num_new_tokens: int, reserve_blocks: int = 0
    ) -> list[tuple[int, int]] | None:
        """Bring a swapped-out request back: device blocks for its computed KV (copied from
        host, pairs returned as (device, host)) plus room for ``num_new_tokens``. None, changing
        nothing, when the device pool cannot provide them while keeping ``reserve_blocks``."""
        rid = request.request_id
        host_ids = self.req_host_blocks[rid]
        need = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        need = max(need, len(host_ids))
        if need + reserve_blocks > self.pool.num_free_blocks:
            return None
        blocks = self.pool.allocate(need)
        self.req_blocks[rid] = blocks
        pairs = [(blocks[i].block_id, host) for i, host in enumerate(host_ids)]
        self.host_pool.free(self.req_host_blocks.pop(rid))
        # copied in before the forward: its full blocks are as good as computed ones
        self.cache_full_blocks(request, request.num_computed_tokens + num_new_tokens)
        return pairs

    def free_host(self, request: Request) -> None:
        """Drop a swapped-out request's host blocks (abort)."""
        host_ids = self.req_host_blocks.pop(request.request_id, None)
        if host_ids:
            self.host_pool.free(host_ids)


def count_prefix_blocks(
    kv: KVCacheManager, request: Request, also_present: Container[BlockHash] = ()
) -> int:
    """Leading full blocks of `request` that are in kv's prefix cache or in `also_present`
    (e.g. hashes of requests already on their way to this pool). Touches nothing; capped
    like a real hit so the last token is always computed."""
    if not kv.enable_caching:
        return 0
    max_blocks = (request.num_tokens - 1) // kv.block_size
    if max_blocks <= 0:
        return 0
    cached = kv.pool.cached
    count = 0
    for block_hash in kv.block_hashes(request, max_blocks):
        if block_hash not in cached and block_hash not in also_present:
            break
        count += 1
    return count


def adapter_hash_seed(lora_name: str) -> BlockHash | None:
    """The parent hash of a request's first block: the same tokens under another LoRA adapter
    have other K/V, so they must not hit each other's blocks (the base model's stays None)."""
    return hashlib.sha256(b"lora\0" + lora_name.encode()).digest() if lora_name else None


def request_block_hashes(request: Request, block_size: int, num_blocks: int) -> list[BlockHash]:
    """The chained hashes of the request's first ``num_blocks`` full blocks (memoised on
    the request; tokens at known positions never change), seeded by its adapter."""
    bs = block_size
    hashes = request.block_hashes
    if request.block_hashes_block_size != bs:
        hashes.clear()
        request.block_hashes_block_size = bs
    if len(hashes) < num_blocks:
        prompt, output = request.prompt_token_ids, request.output_token_ids
        num_prompt = len(prompt)
        parent = hashes[-1] if hashes else adapter_hash_seed(request.lora_name)
        for i in range(len(hashes), num_blocks):
            start, end = i * bs, (i + 1) * bs
            if end <= num_prompt:
                tokens = prompt[start:end]
            elif start >= num_prompt:
                tokens = output[start - num_prompt : end - num_prompt]
            else:
                tokens = prompt[start:] + output[: end - num_prompt]
            parent = hash_block_tokens(parent, tokens)
            hashes.append(parent)
    return hashes
