"""The device's adapter slots: `max_loras` adapters' weights, stacked per layer and site so that
one product serves every row of a step whatever its adapter.

Per layer and site (sites.py): A [slots, parts * max_rank, in], each part's B [slots, max_rank,
out], the scaling and rank [slots, parts]; a slot's rows past an adapter's rank are zeros. A
step's adapters are placed before its forward (`assign`): those already in a slot stay, the
others take a free slot or the least recently used one's that this step does not use.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from worker_svc.lora.adapter_file import AdapterWeights, BaseShapes
from worker_svc.lora.sites import SITES


class TooManyAdapters(ValueError):
    """A step names more adapters than there are slots."""


@dataclass(slots=True)
class SiteSlots:
    a: torch.Tensor  # [slots, parts * max_rank, in] float32
    b: tuple[torch.Tensor, ...]  # per part [slots, max_rank, out] float32
    scale: torch.Tensor  # [slots, parts] float32
    rank: torch.Tensor  # [slots, parts] int32, on the host (the native kernel reads it)
    max_rank: int
    b_pointers: np.ndarray  # int64 addresses of b, for the native kernel
    widths: np.ndarray  # int64 out features of each part

    @classmethod
    def zeros(
        cls, num_slots: int, max_rank: int, features: list[tuple[int, int]], device: torch.device
    ) -> SiteSlots:
        in_features = features[0][1]
        parts = len(features)
        b = tuple(torch.zeros(num_slots, max_rank, out, device=device) for out, _ in features)
        return cls(
            a=torch.zeros(num_slots, parts * max_rank, in_features, device=device),
            b=b,
            scale=torch.zeros(num_slots, parts, device=device),
            rank=torch.zeros(num_slots, parts, dtype=torch.int32),
            max_rank=max_rank,
            b_pointers=np.array([t.data_ptr() for t in b], dtype=np.int64),
            widths=np.array([out for out, _ in features], dtype=np.int64),
        )


class AdapterSlots:
    """Which adapter (by its registry key) is in which slot; used by the step's thread only."""

    def __init__(
        self, num_slots: int, max_rank: int, base: BaseShapes, device: torch.device
    ) -> None:
        self.num_slots, self.max_rank = num_slots, max_rank
        self.layers = [
            {
                site: SiteSlots.zeros(
                    num_slots, max_rank, [base.features[m] for m in parts], device
                )
                for site, parts in SITES.items()
            }
            for _ in range(base.num_layers if num_slots else 0)
        ]
        self._lru: OrderedDict[int, int] = OrderedDict()  # key -> slot, least recent first
        self._names: dict[int, str] = {}
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low slots first

    def assign(
        self, wanted: dict[int, str], weights_of: Callable[[int], AdapterWeights]
    ) -> dict[int, int]:
        """A slot for each wanted adapter (key -> name), filled from `weights_of(key)` where it
        is not in one; never evicts one of `wanted`. Returns key -> slot."""
        if len(wanted) > self.num_slots:
            raise TooManyAdapters(
                f"the step uses {len(wanted)} LoRA adapters, more than max_loras={self.num_slots}"
            )
        placed = {}
        for key in wanted:
            if key in self._lru:
                self._lru.move_to_end(key)
                placed[key] = self._lru[key]
        for key, name in wanted.items():
            if key in placed:
                continue
            slot = self._take_slot(wanted)
            try:
                self._fill(slot, weights_of(key))
            except BaseException:
                self._free.append(slot)
                raise
            self._lru[key], self._names[key], placed[key] = slot, name, slot
        return placed

    def drop(self, key: int) -> None:
        """Forget an adapter that is no longer registered (its slot becomes free)."""
        slot = self._lru.pop(key, None)
        if slot is not None:
            del self._names[key]
            self._free.append(slot)

    def resident(self) -> list[str]:
        """Names in the slots, least recently used first."""
        return [self._names[key] for key in self._lru]

    def _take_slot(self, wanted: dict[int, str]) -> int:
        if self._free:
            return self._free.pop()
        victim = next(key for key in self._lru if key not in wanted)
        del self._names[victim]
        return self._lru.pop(victim)

    def _fill(self, slot: int, weights: AdapterWeights) -> None:
        for sites, held in zip(self.layers, weights.layers, strict=True):
            for site, slots in sites.items():
                w = held.get(site)
                if w is None:
                    slots.a[slot].zero_()
                    for b in slots.b:
                        b[slot].zero_()
                    slots.scale[slot].zero_()
                    slots.rank[slot].zero_()
                    continue
                slots.a[slot].copy_(w.a)
                for b, wb in zip(slots.b, w.b, strict=True):
                    b[slot].copy_(wb)
                slots.scale[slot].copy_(w.scale)
                slots.rank[slot].copy_(w.rank)
