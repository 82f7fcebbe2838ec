"""Placement by LoRA adapter: only workers that run adapters, the adapter's resident workers
first unless much busier, then a free slot; the dispatcher holds or fails what none can run."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from scheduler_svc.core import Request, SchedulerConfig, create_policy, create_request_queue
from scheduler_svc.core import request_block_hashes as block_hashes
from scheduler_svc.engine.dispatcher import Dispatcher
from scheduler_svc.engine.in_flight import InFlightRequest
from scheduler_svc.engine.placement import PlacementConfig, choose
from scheduler_svc.shards.remote_worker import RemoteWorker
from tests.factories import prompt, request

BLOCK = 4
CFG = PlacementConfig(min_prefix_tokens=8, balance_abs=4, balance_rel=2.0)


class NoShard:
    shard_id = "s0"

    def __init__(self) -> None:
        self.assigned: list[tuple[str, str]] = []

    def assign(self, worker_id: str, state: InFlightRequest) -> None:
        self.assigned.append((worker_id, state.request_id))

    def cancel(self, request_id: str) -> None: ...


def worker(
    wid: str, load: int = 0, max_loras: int = 2, resident: set[str] | None = None
) -> RemoteWorker:
    w = RemoteWorker(wid, NoShard(), SchedulerConfig(block_size=BLOCK, num_blocks=64))
    w.request_ids = {f"{wid}-busy{i}" for i in range(load)}
    w.max_loras = max_loras
    w.resident_loras = set(resident or ())
    w.available_loras = {"X", "Y"} if max_loras else set()  # the adapters it has read
    return w


def lora_req(rid: str, lora: str, n: int = 13) -> Request:
    r = request(rid, prompt(n))
    r.lora_name = lora
    return r


def cache(w: RemoteWorker, r: Request) -> None:
    """As if ``r``'s prompt had been computed on ``w``."""
    w.apply_cache_report(block_hashes(r, BLOCK, (r.num_tokens - 1) // BLOCK), [], False)


def test_an_adapter_request_goes_only_to_workers_that_run_adapters():
    base_only = worker("w0", load=0, max_loras=0)
    lora = worker("w1", load=6)
    choice = choose(lora_req("r", "X"), [base_only, lora], CFG)
    assert choice.session is lora
    with pytest.raises(ValueError, match="LoRA"):
        choose(lora_req("r", "X"), [base_only], CFG)
    assert choose(lora_req("r", ""), [base_only, lora], CFG).session is base_only


def test_an_adapter_request_goes_only_to_workers_that_have_read_its_adapter():
    unread = worker("w0", load=0)
    unread.available_loras = {"Y"}
    read = worker("w1", load=6)
    assert choose(lora_req("r", "X"), [unread, read], CFG).session is read


def test_a_worker_with_the_adapter_resident_wins_unless_much_busier():
    least = worker("w0", load=0)
    resident = worker("w1", load=3, resident={"X"})
    choice = choose(lora_req("r", "X"), [least, resident], CFG)
    assert (choice.session, choice.reason) == (resident, "lora")
    resident.request_ids |= {f"more{i}" for i in range(3)}  # 6 > 0 + 4 and > 2 * 0
    choice = choose(lora_req("r", "X"), [least, resident], CFG)
    assert (choice.session, choice.reason) == (least, "lora_free_slot")  # the adapter spreads


def test_without_a_resident_worker_a_free_slot_beats_a_slightly_less_loaded_full_one():
    full = worker("w0", load=0, max_loras=1, resident={"Y"})
    free = worker("w1", load=2, max_loras=1)
    choice = choose(lora_req("r", "X"), [full, free], CFG)
    assert (choice.session, choice.reason) == (free, "lora_free_slot")
    free.request_ids |= {f"more{i}" for i in range(4)}  # much busier now: the least loaded
    choice = choose(lora_req("r", "X"), [full, free], CFG)
    assert (choice.session, choice.reason) == (full, "least_loaded")


def test_among_resident_workers_the_prefix_cached_under_the_adapter_counts():
    a = worker("w0", load=0, resident={"X"})
    b = worker("w1", load=2, resident={"X"})
    cache(b, lora_req("seen", "X"))
    choice = choose(lora_req("r", "X"), [a, b], CFG)
    assert (choice.session, choice.prefix_tokens) == (b, 12)
    # the same prompt computed under another adapter (or the base model) is no hit
    c = worker("w2", load=2, resident={"X"})
    cache(c, lora_req("seen", "Y"))
    cache(c, lora_req("seen", ""))
    choice = choose(lora_req("r", "X"), [a, c], CFG)
    assert (choice.session, choice.prefix_tokens) == (a, 0)


# ---- the dispatcher -----------------------------------------------------------------------


class Sink:
    def __init__(self) -> None:
        self.errors: list[tuple[str, str, str]] = []

    def add_update(self, request_id, start, token_ids, finish_reason=None, error="", **kw):
        if error:
            self.errors.append((request_id, error, kw.get("error_code", "")))
        return False


@dataclass
class Config:
    worker_queue_depth: int = 2


@dataclass
class FakeEngine:
    """What Dispatcher.dispatch reads of the engine."""

    remote_workers: dict[str, RemoteWorker]
    sessions: dict = field(default_factory=dict)
    requests: dict[str, InFlightRequest] = field(default_factory=dict)
    config: Config = field(default_factory=Config)
    placement: PlacementConfig = field(default_factory=lambda: CFG)
    rebuilding: bool = False
    ended: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.policy = create_policy("fcfs")
        self.waiting = create_request_queue(self.policy)

    def submit(self, rid: str, lora: str, sink: Sink) -> None:
        r = lora_req(rid, lora)
        self.requests[rid] = InFlightRequest(rid, r.prompt_token_ids, r.sampling_params, sink)
        self.waiting.add(r)

    def _end(self, state: InFlightRequest) -> None:
        self.requests.pop(state.request_id, None)
        self.ended.append(state.request_id)

    def _cancel_wait_timer(self, state: InFlightRequest) -> None: ...


def test_while_adapter_workers_are_full_an_adapter_request_keeps_its_place_and_others_go_on():
    base_only = worker("w0", max_loras=0)
    lora = worker("w1", load=10)  # its local queue is full (load >= max_num_seqs + depth)
    lora.config.max_num_seqs = 8
    engine = FakeEngine({"w0": base_only, "w1": lora})
    sink = Sink()
    engine.submit("x", "X", sink)
    engine.submit("b", "", sink)
    Dispatcher(engine).dispatch()
    assert [r.request_id for r in engine.waiting] == ["x"]  # held, not failed
    assert base_only.shard.assigned == [("w0", "b")] and not sink.errors
    lora.request_ids.clear()  # room again
    Dispatcher(engine).dispatch()
    assert lora.shard.assigned == [("w1", "x")] and not engine.waiting


def test_an_adapter_request_no_worker_can_run_fails_with_a_sentence():
    engine = FakeEngine({"w0": worker("w0", max_loras=0), "w1": worker("w1", max_loras=0)})
    sink = Sink()
    engine.submit("x", "X", sink)
    engine.submit("b", "", sink)
    Dispatcher(engine).dispatch()
    [(rid, error, code)] = sink.errors
    assert (rid, code) == ("x", "INVALID_ARGUMENT") and "no worker runs LoRA adapters" in error
    assert engine.ended == ["x"] and not engine.waiting
    assert [w.shard.assigned for w in engine.remote_workers.values()] in (
        [[("w0", "b")], []],
        [[], [("w1", "b")]],
    )


def test_a_burst_of_a_new_adapter_follows_its_first_placement_before_any_report():
    """Nothing resident yet on either worker: the second request of a burst goes where the
    first was placed (its adapter is in a slot there by its first step), not to another free
    slot, unless that worker becomes much busier."""
    w0, w1 = worker("w0", load=1), worker("w1", load=0)
    w0.placed_loras["X"] += 1
    choice = choose(lora_req("r", "X"), [w0, w1], CFG)
    assert (choice.session, choice.reason) == (w0, "lora")
    # two other adapters placed on w1 fill its slots: Y then goes to w0's free slot
    w1.placed_loras.update({"A": 1, "B": 1})
    assert choose(lora_req("y", "Y"), [w0, w1], CFG).session is w0
