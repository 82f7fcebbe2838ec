"""The runner's LoRA adapters: registered by name (host memory, registry), placed in device
slots for the steps that use them, and each step's token-to-slot map (StepLora).

    adapters = LoraAdapters(max_loras=4, max_rank=16, max_cpu=8, base=shapes, device=cpu)
    adapters.load("sql", "/adapters/sql")       # LoraInfo, or LoraLoadError (one sentence)
    step = adapters.step(["sql", "", "sql"], num_scheduled)   # None-free: only steps with one

`load` may run on another thread than the steps: it reads and checks the files outside any
lock and registers them under the registry's. max_loras == 0 is LoRA off: loads and requests
naming an adapter are refused.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterable

import numpy as np
import torch

from worker_svc.lora.adapter_file import (
    AdapterWeights,
    BaseShapes,
    LoraInfo,
    LoraLoadError,
    read_adapter,
)
from worker_svc.lora.adapter_registry import AdapterRegistry
from worker_svc.lora.adapter_slots import AdapterSlots
from worker_svc.lora.step_lora import StepLora


class LoraAdapters:
    def __init__(
        self,
        max_loras: int,
        max_rank: int,
        max_cpu: int | None,
        base: BaseShapes,
        device: torch.device,
    ) -> None:
        self.max_loras, self.max_rank, self.base, self.device = max_loras, max_rank, base, device
        self.registry = AdapterRegistry(max_loras if max_cpu is None else max_cpu, self._read)
        self.slots = AdapterSlots(max_loras, max_rank, base, device)
        self._resident: list[str] = []  # the slots' names after the last step (other threads)

    def load(self, name: str, path: str) -> LoraInfo:
        """Register the adapter at `path` as `name` (its LoraInfo again where it already is,
        from this path); LoraLoadError, one sentence, with nothing registered otherwise."""
        if not self.max_loras:
            raise LoraLoadError(f"LoRA adapter {name!r}: LoRA is off on this worker (max_loras=0)")
        if not name or any(c in name for c in ",= \t\n"):
            raise LoraLoadError(f"LoRA adapter name {name!r} is empty or holds , = or spaces")
        path = os.path.abspath(os.path.expanduser(path))
        known = self.registry.known(name, path)
        return known or self.registry.add(self._read(name, path))

    def unload(self, name: str) -> bool:
        """Unregister `name` (False where unknown); requests that hold it keep running it until
        they finish (`collect`)."""
        return self.registry.remove(name)

    def adapters(self) -> list[LoraInfo]:
        return self.registry.infos()

    def resident(self) -> list[str]:
        """Names in the device slots, least recently used first."""
        return list(self._resident)

    def check_requests(self, names: Iterable[str]) -> None:
        """ValueError naming the first adapter of new requests that is not registered."""
        for name in names:
            if name and not self.registry.is_registered(name):
                off = " (LoRA is off on this worker: max_loras=0)" if not self.max_loras else ""
                raise ValueError(f"LoRA adapter {name!r} is not loaded on this worker{off}")

    def collect(self, in_use: Callable[[], Collection[str]]) -> None:
        """Free what unloaded adapters held once no request (`in_use()`'s names) holds them."""
        if self.registry.has_removed:
            for key in self.registry.collect(in_use()):
                self.slots.drop(key)
            self._resident = self.slots.resident()

    def step(self, adapters: list[str], num_scheduled: np.ndarray) -> StepLora:
        """The step's map, its adapters placed in slots first: `adapters` per packed request
        ("" = the base model), `num_scheduled` its tokens."""
        keys = self.registry.keys(set(adapters) - {""})
        placed = self.slots.assign(keys, lambda key: self.registry.weights(key, keys[key]))
        self._resident = self.slots.resident()
        slot_of = {keys[key]: slot for key, slot in placed.items()}
        request_slots = np.fromiter(
            (slot_of[n] if n else -1 for n in adapters), dtype=np.int64, count=len(adapters)
        )
        return StepLora.of(self.slots.layers, request_slots, num_scheduled, self.device)

    def _read(self, name: str, path: str) -> AdapterWeights:
        return read_adapter(name, path, self.base, self.max_rank)
