"""The paged KV cache: device blocks for attention, host blocks for swapped-out requests.

One allocation per pool, [layers, 2 (K, V), blocks, block_size, kv_heads, head_dim], so a swap
is one index_select + one index_copy over all layers; `key_caches[l]` / `value_caches[l]` are
views [blocks, block_size, kv_heads, head_dim] of layer l. Memory starts zeroed: padding slots
that attention masks out are still read, and must hold finite numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes over all layers, K and V."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


class KVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        num_host_blocks: int = 0,
        scratch_blocks: int = 0,
    ) -> None:
        """`scratch_blocks` more device blocks past num_blocks, never handed to a request: where
        the padded rows of a captured decode step write (worker_svc.cuda_graphs)."""
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.device = device
        self.scratch_block = num_blocks if scratch_blocks else None
        shape = (num_layers, 2, num_blocks + scratch_blocks, block_size, num_kv_heads, head_dim)
        self.device_cache = torch.zeros(shape, dtype=dtype, device=device)
        host_shape = (num_layers, 2, num_host_blocks, block_size, num_kv_heads, head_dim)
        pin = device.type == "cuda" and num_host_blocks > 0
        self.host_cache = torch.zeros(host_shape, dtype=dtype, device="cpu", pin_memory=pin)
        self.key_caches = [self.device_cache[layer, 0] for layer in range(num_layers)]
        self.value_caches = [self.device_cache[layer, 1] for layer in range(num_layers)]

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks, [(device_block, host_block), ...]."""
        if not pairs:
            return
        dev, host = self._ids(pairs)
        blocks = self.device_cache.index_select(2, dev.to(self.device))
        self.host_cache.index_copy_(2, host, blocks.to("cpu"))

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks, [(device_block, host_block), ...]."""
        if not pairs:
            return
        dev, host = self._ids(pairs)
        blocks = self.host_cache.index_select(2, host)
        self.device_cache.index_copy_(
            2, dev.to(self.device), blocks.to(self.device, non_blocking=True)
        )

    def _ids(self, pairs: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(pairs, dtype=torch.int64).view(-1, 2)
        dev, host = ids[:, 0], ids[:, 1]
        if int(dev.min()) < 0 or int(dev.max()) >= self.num_blocks:
            raise ValueError(f"device block id out of range [0, {self.num_blocks}): {pairs}")
        if int(host.min()) < 0 or int(host.max()) >= self.num_host_blocks:
            raise ValueError(f"host block id out of range [0, {self.num_host_blocks}): {pairs}")
        return dev, host
