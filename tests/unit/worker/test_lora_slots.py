"""Where adapters live: device slots (least recently used evicted, never one the step uses) and
the host cache (least recently used dropped, read from disk again when a step needs it)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from worker_svc.lora.adapter_file import (  # noqa: E402
    AdapterWeights,
    BaseShapes,
    LoraInfo,
    LoraLoadError,
    SiteWeights,
)
from worker_svc.lora.adapter_registry import AdapterRegistry  # noqa: E402
from worker_svc.lora.adapter_slots import AdapterSlots, TooManyAdapters  # noqa: E402
from worker_svc.lora.sites import SITES  # noqa: E402

CPU = torch.device("cpu")
BASE = BaseShapes(
    2,
    {
        "q_proj": (8, 8),
        "k_proj": (4, 8),
        "v_proj": (4, 8),
        "o_proj": (8, 8),
        "gate_proj": (12, 8),
        "up_proj": (12, 8),
        "down_proj": (8, 12),
    },
)
RANK = 2


def fake_weights(name: str, seed: int, sites=tuple(SITES)) -> AdapterWeights:
    """Random weights in the slot layout (adapter_file's), value `seed` everywhere in A."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(BASE.num_layers):
        held = {}
        for site in sites:
            parts = SITES[site]
            in_features = BASE.features[parts[0]][1]
            held[site] = SiteWeights(
                a=torch.full((len(parts) * RANK, in_features), float(seed)),
                b=tuple(torch.randn(RANK, BASE.features[m][0], generator=gen) for m in parts),
                scale=torch.full((len(parts),), 0.5 * seed),
                rank=torch.full((len(parts),), RANK, dtype=torch.int32),
            )
        layers.append(held)
    return AdapterWeights(LoraInfo(name, f"/{name}", RANK, ()), layers)


class Reads:
    """weights_of for AdapterSlots, counting what it is asked for."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def __call__(self, key: int) -> AdapterWeights:
        self.asked.append(key)
        return fake_weights(f"a{key}", seed=key)


def slot_holds(slots: AdapterSlots, slot: int, key: int) -> bool:
    return all(
        torch.all(site.a[slot] == float(key)) and torch.all(site.scale[slot] == 0.5 * key)
        for layer in slots.layers
        for site in layer.values()
    )


def test_least_recently_used_slot_goes_first():
    slots, reads = AdapterSlots(2, RANK, BASE, CPU), Reads()
    assert slots.assign({1: "a1"}, reads) == {1: 0}  # low slots first
    assert slots.assign({2: "a2"}, reads) == {2: 1}
    assert slots.assign({1: "a1"}, reads) == {1: 0} and reads.asked == [1, 2]  # a hit
    assert slots.resident() == ["a2", "a1"]  # least recently used first
    assert slots.assign({3: "a3"}, reads) == {3: 1}  # a2 was the least recently used
    assert slots.resident() == ["a1", "a3"] and reads.asked == [1, 2, 3]
    assert slot_holds(slots, 0, 1) and slot_holds(slots, 1, 3)


def test_a_step_never_evicts_its_own_adapters():
    slots, reads = AdapterSlots(3, RANK, BASE, CPU), Reads()
    slots.assign({1: "a1", 2: "a2", 3: "a3"}, reads)
    placed = slots.assign({3: "a3", 4: "a4", 5: "a5"}, reads)  # 1 and 2 go, 3 stays
    assert placed[3] == 2 and sorted(placed.values()) == [0, 1, 2]
    assert slots.resident() == ["a3", "a4", "a5"]
    for key, slot in placed.items():
        assert slot_holds(slots, slot, key)


def test_more_adapters_than_slots_fail_the_step():
    slots = AdapterSlots(2, RANK, BASE, CPU)
    with pytest.raises(TooManyAdapters, match="3 LoRA adapters, more than max_loras=2"):
        slots.assign({1: "a1", 2: "a2", 3: "a3"}, Reads())
    assert slots.resident() == []


def test_a_failed_fill_leaves_the_slot_free():
    slots = AdapterSlots(1, RANK, BASE, CPU)

    def broken(key):
        raise LoraLoadError("gone")

    with pytest.raises(LoraLoadError):
        slots.assign({1: "a1"}, broken)
    assert slots.resident() == []
    assert slots.assign({2: "a2"}, Reads()) == {2: 0}


def test_untargeted_sites_are_zeroed_and_dropped_slots_reused():
    slots = AdapterSlots(1, RANK, BASE, CPU)
    slots.assign({1: "a1"}, Reads())
    slots.drop(1)
    assert slots.resident() == []
    slots.assign({2: "q-only"}, lambda key: fake_weights("q-only", seed=2, sites=("qkv",)))
    layer = slots.layers[0]
    assert torch.all(layer["qkv"].a[0] == 2.0)
    for site in ("o", "gate_up", "down"):  # nothing of adapter 1 left
        assert not layer[site].a[0].any() and not layer[site].scale[0].any()
        assert not layer[site].rank[0].any() and not any(b[0].any() for b in layer[site].b)


def test_host_cache_drops_the_least_recently_used_and_reads_it_again():
    read = []

    def reader(name, path):
        read.append(name)
        return fake_weights(name, seed=int(name[1:]))

    registry = AdapterRegistry(2, reader)
    for i in (1, 2, 3):
        registry.add(reader(f"a{i}", f"/a{i}"))
    assert registry.host_resident() == ["a2", "a3"]  # a1 dropped from host memory
    keys = registry.keys(["a1", "a2", "a3"])
    key_of = {name: key for key, name in keys.items()}
    read.clear()
    registry.weights(key_of["a2"], "a2")
    assert read == [] and registry.host_resident() == ["a3", "a2"]
    again = registry.weights(key_of["a1"], "a1")  # read from its path
    assert read == ["a1"] and torch.all(again.layers[0]["qkv"].a == 1.0)
    assert registry.host_resident() == ["a2", "a1"]
    assert [i.name for i in registry.infos()] == ["a1", "a2", "a3"]  # all still registered


def test_unloaded_adapter_stays_for_its_requests():
    registry = AdapterRegistry(4, lambda name, path: fake_weights(name, 1))
    registry.add(fake_weights("a1", 1))
    key = next(iter(registry.keys(["a1"])))
    assert registry.remove("a1") and not registry.is_registered("a1")
    assert registry.infos() == []
    assert registry.keys(["a1"]) == {key: "a1"}  # requests that hold it still run it
    assert registry.collect({"a1"}) == []
    assert registry.collect(set()) == [key]
    with pytest.raises(ValueError, match="'a1' is not loaded"):
        registry.keys(["a1"])


def test_step_map_groups_tokens_by_slot():
    from worker_svc.lora.step_lora import StepLora

    step = StepLora.of([], np.array([2, -1, 0, 2]), np.array([1, 3, 2, 1]), CPU)
    assert step.token_slots.tolist() == [2, -1, -1, -1, 0, 0, 2] and step.num_slots == 3
    tokens, slots = step.by_slot()
    assert tokens.tolist() == [4, 5, 0, 6] and slots.tolist() == [0, 0, 2, 2]
    hot = step.one_hot()
    assert hot.shape == (7, 3) and hot.sum(1).tolist() == [1, 0, 0, 0, 1, 1, 1]
    assert hot[0, 2] == 1 and hot[4, 0] == 1
