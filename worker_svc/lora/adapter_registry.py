"""The registered adapters and their host copies; safe to call from any thread.

A name is registered once with its path (`add`), and keeps that path until `remove`. Up to
`max_cpu` adapters' weights stay in host memory, least recently used dropped first; a dropped
one is read from its path again when a step needs it. An adapter removed while requests still
hold it (running or preempted) stays usable by them, hidden from the listing, until `collect`
finds none left. Each registration has its own key, so a device slot of an adapter that was
removed and registered again under the same name is never taken for the new one.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass

from worker_svc.lora.adapter_file import AdapterWeights, LoraInfo, LoraLoadError


@dataclass(slots=True)
class _Entry:
    info: LoraInfo
    key: int
    removed: bool = False  # unloaded, kept for the requests that still use it


class AdapterRegistry:
    def __init__(self, max_cpu: int, read: Callable[[str, str], AdapterWeights]) -> None:
        self._max_cpu, self._read = max_cpu, read
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._host: OrderedDict[int, AdapterWeights] = OrderedDict()  # least recent first
        self._keys = itertools.count(1)

    def known(self, name: str, path: str) -> LoraInfo | None:
        """The registration of `name` where it is this path; LoraLoadError where another."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return None
            if entry.info.path != path:
                raise LoraLoadError(
                    f"LoRA adapter {name!r} is already loaded from {entry.info.path}"
                    + (" and still in use after its unload" if entry.removed else "")
                )
            entry.removed = False
            return entry.info

    def add(self, weights: AdapterWeights) -> LoraInfo:
        """Register weights read outside the lock (a second add of the name keeps the first)."""
        info = weights.info
        with self._lock:
            entry = self._entries.get(info.name)
            if entry is None:
                entry = self._entries[info.name] = _Entry(info, next(self._keys))
                self._keep(entry.key, weights)
        return self.known(info.name, info.path) or info

    def remove(self, name: str) -> bool:
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or entry.removed:
                return False
            entry.removed = True
            return True

    def infos(self) -> list[LoraInfo]:
        with self._lock:
            return [e.info for e in self._entries.values() if not e.removed]

    def is_registered(self, name: str) -> bool:
        with self._lock:
            entry = self._entries.get(name)
            return entry is not None and not entry.removed

    def keys(self, names: Collection[str]) -> dict[int, str]:
        """key -> name of each (removed ones included: running requests keep theirs)."""
        with self._lock:
            missing = [n for n in names if n not in self._entries]
            if missing:
                raise ValueError(f"LoRA adapter {missing[0]!r} is not loaded on this worker")
            return {self._entries[n].key: n for n in names}

    def weights(self, key: int, name: str) -> AdapterWeights:
        """The host copy, read from its path again where it was dropped from host memory."""
        with self._lock:
            weights = self._host.get(key)
            if weights is not None:
                self._host.move_to_end(key)
                return weights
            path = self._entries[name].info.path
        weights = self._read(name, path)
        with self._lock:
            self._keep(key, weights)
        return weights

    def collect(self, in_use: Collection[str]) -> list[int]:
        """Forget removed adapters no request holds; returns their keys."""
        with self._lock:
            gone = [n for n, e in self._entries.items() if e.removed and n not in in_use]
            keys = [self._entries.pop(n).key for n in gone]
            for key in keys:
                self._host.pop(key, None)
            return keys

    @property
    def has_removed(self) -> bool:
        return any(e.removed for e in self._entries.values())

    def host_resident(self) -> list[str]:
        """Names whose weights are in host memory, least recently used first."""
        with self._lock:
            by_key = {e.key: n for n, e in self._entries.items()}
            return [by_key[k] for k in self._host if k in by_key]

    def _keep(self, key: int, weights: AdapterWeights) -> None:
        self._host[key] = weights
        self._host.move_to_end(key)
        while len(self._host) > self._max_cpu:
            self._host.popitem(last=False)
