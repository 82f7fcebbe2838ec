"""LoRA adapters in the scheduler core: slots per worker step, skipped (never blocking) requests,
no starvation, adapters kept through preemption and swap, stats, adapter-seeded prefix hashes."""

from __future__ import annotations

import functools
import itertools

import pytest

from scheduler_svc.core import RequestRejected, Scheduler, SchedulerOutput, request_block_hashes
from scheduler_svc.core.block_pool import hash_block_tokens
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.step_state import StepState
from scheduler_svc.core.worker_view import new_request_data
from tests.factories import prompt, request, scheduler_factory

make = scheduler_factory(
    max_num_batched_tokens=256,
    max_num_seqs=64,
    block_size=4,
    num_blocks=512,
    watermark=0.0,
    max_model_len=256,
    max_loras=1,
)
_tok = itertools.count(1000)


def lora_req(rid: str, lora: str = "", n: int = 6, max_tokens: int = 4, **kw) -> Request:
    r = request(rid, prompt(n, start=kw.pop("start", 1)), max_tokens=max_tokens, **kw)
    r.lora_name = lora
    return r


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    sampled = {}
    for rid in out.num_scheduled_tokens:
        r = s.get_request(rid)
        done = r is not None and r.num_computed_tokens >= r.num_tokens
        sampled[rid] = [next(_tok)] if done else []
    s.update_from_output(out, sampled)
    return out


def new_ids(out: SchedulerOutput) -> list[str]:
    return [n.request_id for n in out.new_requests]


def running_adapters(s: Scheduler) -> set[str]:
    return {r.lora_name for r in s.running if r.lora_name}


def test_an_adapter_without_a_slot_is_skipped_and_the_queue_behind_it_goes_on():
    s = make()
    s.add_request(lora_req("x1", "X", max_tokens=20))
    assert new_ids(step(s)) == ["x1"]
    for r in (lora_req("y1", "Y"), lora_req("x2", "X"), lora_req("b1")):
        s.add_request(r)
    out = step(s)
    assert new_ids(out) == ["x2", "b1"]  # y1 at the head found no slot; those behind it went
    assert [r.request_id for r in s.waiting] == ["y1"]  # it keeps its place
    assert s.get_request("y1").lora_skipped_steps == 1
    assert running_adapters(s) == {"X"}


def test_running_requests_not_scheduled_this_step_still_hold_their_adapter_slot():
    # x1's last token is on its way (async scheduling): it is not scheduled, but it runs
    s = make(max_num_batched_tokens=8, enable_chunked_prefill=True)
    s.add_request(lora_req("x1", "X", n=4, max_tokens=1))
    out = s.schedule()  # x1 prefills and samples its one token; its output is not back yet
    assert new_ids(out) == ["x1"]
    s.add_request(lora_req("y1", "Y", n=4))
    out2 = s.schedule()
    assert "x1" not in out2.num_scheduled_tokens and "y1" not in out2.num_scheduled_tokens
    s.update_from_output(out, {"x1": [5]})  # x1 ends: its slot frees
    s.update_from_output(out2, {})
    assert new_ids(step(s)) == ["y1"]


def test_two_slots_hold_two_adapters_and_a_third_waits():
    s = make(max_loras=2)
    for r in (lora_req("x1", "X", max_tokens=20), lora_req("y1", "Y", max_tokens=20)):
        s.add_request(r)
    step(s)
    s.add_request(lora_req("z1", "Z"))
    s.add_request(lora_req("y2", "Y"))
    assert new_ids(step(s)) == ["y2"]
    assert running_adapters(s) == {"X", "Y"}


def test_in_one_step_admissions_take_slots_as_they_go():
    s = make(max_loras=2)
    for r in (lora_req("x1", "X"), lora_req("y1", "Y"), lora_req("z1", "Z"), lora_req("x2", "X")):
        s.add_request(r)
    assert new_ids(step(s)) == ["x1", "y1", "x2"]


def test_a_request_naming_an_adapter_is_rejected_where_max_loras_is_zero():
    s = make(max_loras=0)
    with pytest.raises(RequestRejected, match="max_loras 0"):
        s.add_request(lora_req("x1", "X"))
    s.add_request(lora_req("b1"))  # the base model runs anywhere
    with pytest.raises(RequestRejected, match="max_loras 0"):
        s.adopt_request(lora_req("x2", "X", out=[5]), [1, 2], 6)


def _stream_of_x(starvation_steps: int, steps: int) -> tuple[Scheduler, list[set[str]], int | None]:
    """max_loras=1, a new X request every step, a Y request early on: the X requests admitted
    each step, and the step at which Y got in (None: never)."""
    s = make(lora_starvation_steps=starvation_steps)
    x_admitted: list[set[str]] = []
    y_in = None
    for i in range(steps):
        s.add_request(lora_req(f"x{i}", "X", max_tokens=3))
        if i == 1:
            s.add_request(lora_req("y", "Y", max_tokens=3))
        out = step(s)
        x_admitted.append({rid for rid in new_ids(out) if rid.startswith("x")})
        if "y" in new_ids(out):
            y_in = i
    return s, x_admitted, y_in


def test_without_the_guard_a_steady_flow_of_one_adapter_starves_another():
    _, _, y_in = _stream_of_x(starvation_steps=10**6, steps=60)
    assert y_in is None


def test_a_starving_adapter_stops_other_adapters_behind_it_until_it_is_admitted():
    s, x_admitted, y_in = _stream_of_x(starvation_steps=5, steps=60)
    # skipped from step 1, starving once skipped more than 5 steps (step 6); the X requests
    # running then take their 3 steps to finish
    starving_from = 6
    assert y_in is not None and y_in <= starving_from + 3
    assert all(not xs for xs in x_admitted[starving_from:y_in])  # no X behind it got in
    assert x_admitted[starving_from - 1]  # before, X requests were admitted every step
    assert not s.get_request("y")  # it ran and finished
    # and then the X requests, skipped in turn, get back in once Y has drained
    assert any(x_admitted[y_in + 1 :])


def test_base_model_requests_are_admitted_while_an_adapter_starves():
    s = make(lora_starvation_steps=0)
    s.add_request(lora_req("x0", "X", max_tokens=10))
    step(s)
    for r in (lora_req("y", "Y"), lora_req("x1", "X"), lora_req("b1")):
        s.add_request(r)
    out = step(s)
    assert new_ids(out) == ["b1"]  # y starves at once; x1 behind it waits; the base goes
    assert [r.request_id for r in s.waiting] == ["y", "x1"]


def test_a_preempted_request_keeps_its_adapter_and_its_slot_counts_again_on_return():
    s = make(num_blocks=6, max_num_batched_tokens=64, max_loras=2)
    s.add_request(lora_req("b", n=8, max_tokens=30))
    s.add_request(lora_req("x", "X", n=8, max_tokens=30))
    preempted = False
    for _ in range(20):
        out = step(s)
        if "x" in out.preempted_req_ids:
            preempted = True
            break
    assert preempted
    x = s.get_request("x")
    assert x.status is RequestStatus.PREEMPTED and x.lora_name == "X"
    assert s.stats().waiting_loras == {"X": 1} and s.stats().running_loras == {}


def test_a_request_sent_as_new_carries_its_adapter_after_migration_or_adoption():
    r = lora_req("x", "X", out=[7, 8])
    assert new_request_data(r, [1, 2], 4).lora_name == "X"
    assert new_request_data(lora_req("b"), [1], 0).lora_name == ""
    s = make()
    s.adopt_request(lora_req("a", "A", n=10, out=[50, 51]), [7, 3, 11], 11)
    [new] = s.schedule().new_requests
    assert (new.request_id, new.lora_name) == ("a", "A")
    s2 = make()
    s2.add_request(lora_req("m", "M", out=[5, 6]))  # moved from a lost worker with its output
    [new] = s2.schedule().new_requests
    assert (new.output_token_ids, new.lora_name) == ([5, 6], "M")


def test_a_swapped_request_keeps_its_adapter_and_without_a_slot_does_not_block_the_queue():
    s = make(preemption_mode="swap", num_host_blocks=32, num_blocks=32)
    s.add_request(lora_req("y", "Y", n=8, max_tokens=30))
    s.add_request(lora_req("w", n=8, max_tokens=30))
    step(s)
    y, w = s.get_request("y"), s.get_request("w")
    for victim in (w, y):  # swapped out as a preemption does it: y ends up at the head
        s.running.remove(victim)
        s._preemptor.preempt(victim, StepState(step_id=99, budget=0))
    assert y.status is RequestStatus.SWAPPED and y.lora_name == "Y"
    assert [r.request_id for r in s.swapped] == ["y", "w"]
    # a new leader adopts an X row meanwhile: the one slot is X's
    free = sorted(set(range(32)) - {b for r in s.running for b in s.kv.block_ids(r.request_id)})
    s.adopt_request(lora_req("x", "X", n=4, max_tokens=3), free[:1], 3)
    s.add_request(lora_req("b"))
    out = step(s)
    assert "y" not in out.num_scheduled_tokens and new_ids(out) == ["x", "b"]
    assert w.status is RequestStatus.RUNNING and out.blocks_to_swap_in  # w behind y resumed
    assert y.status is RequestStatus.SWAPPED and y.lora_skipped_steps == 1
    assert s.stats().waiting_loras == {"Y": 1} and s.stats().running_loras == {"X": 1}
    for _ in range(10):
        out = step(s)
        if "y" in out.num_scheduled_tokens:
            break
    [resumed] = [c for c in out.cached_requests if c.request_id == "y"]
    assert resumed.resumed and out.blocks_to_swap_in  # the worker's row has its adapter
    assert y.lora_name == "Y" and running_adapters(s) == {"Y"}


def test_stats_count_running_and_waiting_adapters():
    s = make(max_loras=2)
    for r in (
        lora_req("x1", "X", max_tokens=20),
        lora_req("x2", "X", max_tokens=20),
        lora_req("y1", "Y", max_tokens=20),
        lora_req("z1", "Z"),
        lora_req("z2", "Z"),
        lora_req("b1"),
    ):
        s.add_request(r)
    st = s.stats()
    assert (st.running_loras, st.waiting_loras) == ({}, {"X": 2, "Y": 1, "Z": 2})
    step(s)
    st = s.stats()
    assert (st.running_loras, st.waiting_loras) == ({"X": 2, "Y": 1}, {"Z": 2})
    s.abort_request("z1")
    s.abort_request("x1")
    st = s.stats()
    assert (st.running_loras, st.waiting_loras) == ({"X": 1, "Y": 1}, {"Z": 1})
    assert st["running_loras"] == {"X": 1, "Y": 1}


def test_steps_without_adapter_requests_never_build_adapter_slots():
    s = make()
    for i in range(20):
        s.add_request(lora_req(f"b{i}"))
        step(s)
    assert s._admitter._slots is None and not s._adapters.requests


def test_prefix_hits_need_the_same_adapter():
    s = make(max_loras=2)
    base = functools.partial(lora_req, n=17, max_tokens=1)
    for rid, lora in (("b", ""), ("x", "X"), ("x2", "X"), ("y", "Y")):
        s.add_request(base(rid, lora))
        while s.has_unfinished_requests():
            step(s)
    cached = {}
    for rid, lora in (("b2", ""), ("x3", "X"), ("y2", "Y"), ("z", "Z")):
        r = base(rid, lora)
        s.add_request(r)
        step(s)
        cached[rid] = r.num_cached_tokens
    assert cached == {"b2": 16, "x3": 16, "y2": 16, "z": 0}


def test_the_first_computation_under_another_adapter_misses_the_base_models_blocks():
    s = make()
    first = lora_req("b", n=17, max_tokens=1)
    s.add_request(first)
    step(s)
    x = lora_req("x", "X", n=17, max_tokens=1)
    s.add_request(x)
    step(s)
    assert first.num_cached_tokens == 0 and x.num_cached_tokens == 0
    x2 = lora_req("x2", "X", n=17, max_tokens=1)
    s.add_request(x2)
    step(s)
    assert x2.num_cached_tokens == 16


def test_base_model_block_hashes_are_unchanged_and_adapters_seed_theirs():
    r = lora_req("b", n=8)
    h0 = hash_block_tokens(None, prompt(4))
    assert request_block_hashes(r, 4, 2) == [h0, hash_block_tokens(h0, prompt(4, start=5))]
    x, y = lora_req("x", "X", n=8), lora_req("y", "Y", n=8)
    hx, hy = request_block_hashes(x, 4, 2), request_block_hashes(y, 4, 2)
    assert hx[0] != h0 and hy[0] != h0 and hx[0] != hy[0]
    assert hx == request_block_hashes(lora_req("x2", "X", n=8), 4, 2)
