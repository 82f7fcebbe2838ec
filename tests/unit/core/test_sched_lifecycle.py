"""Abort in every state, stop conditions, stale outputs."""

from __future__ import annotations

import functools

import pytest

from scheduler_svc.core import (
    FinishReason,
    RequestStatus,
    Scheduler,
)
from tests.factories import request, scheduler_factory

make = scheduler_factory(
    max_num_batched_tokens=16,
    max_num_seqs=8,
    block_size=4,
    num_blocks=32,
    watermark=0.0,
    max_model_len=64,
)

req = functools.partial(request, max_tokens=20)


def run(s: Scheduler, tokens: dict[str, list[int]], max_steps: int = 100):
    """Drive until idle; request rid samples tokens[rid] in order. Returns rid -> outputs."""
    got: dict[str, list] = {}
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        sampled = {}
        for rid in out.num_scheduled_tokens:
            r = s.get_request(rid)
            if r.num_computed_tokens == r.num_tokens:
                sampled[rid] = [tokens[rid][len(r.output_token_ids)]]
            else:
                sampled[rid] = []
        for o in s.update_from_output(out, sampled):
            got.setdefault(o.request_id, []).append(o)
    assert not s.has_unfinished_requests()
    return got


def final(outs):
    toks = [t for o in outs for t in o.new_token_ids]
    return toks, outs[-1].finish_reason, outs[-1].stop_reason


# ---- stop conditions --------------------------------------------------------------------------


def test_eos_stops_with_stop_reason_the_token():
    s = make()
    s.add_request(req("a", [1, 2], eos=2))
    toks, reason, stop = final(run(s, {"a": [5, 6, 2, 7, 8]})["a"])
    assert toks == [5, 6, 2] and reason is FinishReason.STOP and stop == 2


def test_ignore_eos_continues_to_max_tokens():
    s = make()
    s.add_request(req("a", [1, 2], eos=2, ignore_eos=True, max_tokens=4))
    toks, reason, stop = final(run(s, {"a": [5, 2, 2, 7, 8]})["a"])
    assert toks == [5, 2, 2, 7] and reason is FinishReason.LENGTH and stop is None


def test_stop_token_ids_stop_even_with_ignore_eos():
    s = make()
    s.add_request(req("a", [1], eos=2, ignore_eos=True, stop_token_ids=[9, 11]))
    toks, reason, stop = final(run(s, {"a": [5, 2, 11, 4]})["a"])
    assert toks == [5, 2, 11] and reason is FinishReason.STOP and stop == 11


def test_min_tokens_defers_eos_and_stop_tokens():
    s = make()
    s.add_request(req("a", [1], eos=2, min_tokens=3, stop_token_ids=[9]))
    toks, reason, _ = final(run(s, {"a": [2, 9, 2, 5]})["a"])
    assert toks == [2, 9, 2] and reason is FinishReason.STOP  # 3rd output may stop


def test_max_tokens_gives_length():
    s = make()
    s.add_request(req("a", [1, 2, 3], max_tokens=3))
    outs = run(s, {"a": [4, 5, 6, 7]})["a"]
    toks, reason, _ = final(outs)
    assert toks == [4, 5, 6] and reason is FinishReason.LENGTH
    assert [o.num_output_tokens for o in outs] == [1, 2, 3]


def test_max_model_len_gives_length_when_tokens_reach_it():
    s = make(max_model_len=8)
    s.add_request(req("a", range(5), max_tokens=100))
    toks, reason, _ = final(run(s, {"a": list(range(10, 30))})["a"])
    assert len(toks) == 3 and reason is FinishReason.LENGTH  # 5 + 3 == 8


def test_length_wins_over_eos_on_the_same_token():
    s = make()
    s.add_request(req("a", [1], eos=2, max_tokens=2))
    toks, reason, _ = final(run(s, {"a": [5, 2]})["a"])
    assert toks == [5, 2] and reason is FinishReason.LENGTH


def test_finished_blocks_freed_but_full_ones_stay_cached():
    s = make()
    s.add_request(req("a", range(9), max_tokens=2))
    run(s, {"a": [1, 2]})
    st = s.stats()
    assert st.kv_usage == 0.0 and st.num_free_blocks == 32
    assert st.num_cached_blocks == 2  # positions 0..7 (9 prompt + 1 output - 1 uncomputed)


def test_multiple_tokens_in_one_step_are_appended_until_a_stop():
    s = make()
    s.add_request(req("a", [1], eos=2))
    out = s.schedule()
    (o,) = s.update_from_output(out, {"a": [5, 6, 2, 8]})
    assert o.new_token_ids == [5, 6, 2] and o.finish_reason is FinishReason.STOP


# ---- abort ------------------------------------------------------------------------------------


def test_abort_waiting_request():
    s = make()
    s.add_request(req("a", [1, 2]))
    assert s.abort_request("a")
    assert not s.has_unfinished_requests()
    out = s.schedule()
    assert out.finished_req_ids == {"a"} and out.num_scheduled_tokens == {}
    assert s.stats().num_aborted == 1
    assert not s.abort_request("a")  # gone


def test_abort_mid_prefill_frees_blocks():
    s = make(max_num_batched_tokens=4)
    r = req("a", range(10))
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, {"a": []})
    assert s.stats().num_free_blocks == 31
    assert s.abort_request("a")
    assert r.status is RequestStatus.FINISHED and r.finish_reason is FinishReason.ABORT
    assert s.stats().num_free_blocks == 32 and s.stats().kv_usage == 0.0
    assert s.schedule().finished_req_ids == {"a"}


def test_abort_decoding_request_between_schedule_and_update_ignores_its_output():
    s = make()
    s.add_request(req("a", [1, 2, 3]))
    s.add_request(req("b", [4, 5, 6]))
    out = s.schedule()
    s.update_from_output(out, {"a": [7], "b": [8]})
    out = s.schedule()
    assert s.abort_request("a")
    outs = s.update_from_output(out, {"a": [9], "b": [10]})  # a's token arrives late
    assert [o.request_id for o in outs] == ["b"]
    assert s.stats().num_free_blocks == 31  # only b's block remains
    assert [r.request_id for r in s.running] == ["b"]
    assert s.schedule().finished_req_ids == {"a"}


def test_abort_preempted_request_waiting_again():
    s = make(num_blocks=4, enable_prefix_caching=False, max_num_batched_tokens=64)
    s.add_request(req("r1", range(7), arrival=1))
    s.add_request(req("r2", range(100, 107), arrival=2))
    for _ in range(3):
        out = s.schedule()
        s.update_from_output(out, {rid: [1] for rid in out.num_scheduled_tokens})
    assert out.preempted_req_ids == {"r2"}
    r2 = s.get_request("r2")
    assert r2.status is RequestStatus.PREEMPTED
    assert s.abort_request("r2")
    assert len(s.waiting) == 0
    assert s.schedule().finished_req_ids == {"r2"}  # the worker still held its state
    s.abort_request("r1")
    assert s.stats().num_free_blocks == 4


def test_abort_finished_request_returns_false():
    s = make()
    s.add_request(req("a", [1], max_tokens=1))
    out = s.schedule()
    s.update_from_output(out, {"a": [3]})
    assert not s.abort_request("a")
    assert not s.abort_request("never-seen")


def test_request_id_can_be_reused_after_it_finished():
    s = make()
    s.add_request(req("a", [1], max_tokens=1))
    out = s.schedule()
    s.update_from_output(out, {"a": [3]})
    s.add_request(req("a", [2], max_tokens=1))
    out = s.schedule()
    # the old one is reported finished; the new one waits one step so the worker never sees
    # one id both finished and new in one diff
    assert out.finished_req_ids == {"a"} and out.new_requests == []
    out = s.schedule()
    assert [n.request_id for n in out.new_requests] == ["a"]


def test_stale_output_of_a_preempted_then_readmitted_request_is_ignored():
    s = make(num_blocks=4, enable_prefix_caching=False, max_num_batched_tokens=64)
    s.add_request(req("r1", range(7), arrival=1))
    s.add_request(req("r2", range(100, 107), arrival=2))
    outs = []
    for _ in range(2):
        out = s.schedule()
        s.update_from_output(out, {rid: [1] for rid in out.num_scheduled_tokens})
        outs.append(out)
    old = outs[-1]  # r2 was scheduled in it
    out = s.schedule()
    assert out.preempted_req_ids == {"r2"}
    s.update_from_output(out, {"r1": [1]})
    s.abort_request("r1")
    out = s.schedule()  # r2 readmitted (resumed)
    assert out.cached_requests[0].resumed
    n_out = len(s.get_request("r2").output_token_ids)
    assert s.update_from_output(old, {"r2": [99]}) == []  # from before the preemption
    assert len(s.get_request("r2").output_token_ids) == n_out


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_abort_from_middle_of_waiting_queue_keeps_order(policy):
    s = make(policy=policy, max_num_seqs=1)
    for i in range(6):
        s.add_request(req(f"r{i}", [i + 1], arrival=float(i)))
    assert s.abort_request("r3") and s.abort_request("r0")
    assert [r.request_id for r in s.waiting] == ["r1", "r2", "r4", "r5"]
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["r1"]


# ---- swap -------------------------------------------------------------------------------------


def _swap_setup(**kw) -> Scheduler:
    # 4 device blocks of 4: r1, r2 (7-token prompts) fill the pool after two steps
    s = make(
        num_blocks=4,
        enable_prefix_caching=False,
        max_num_batched_tokens=64,
        preemption_mode="swap",
        num_host_blocks=4,
        **kw,
    )
    s.add_request(req("r1", range(7), arrival=1))
    s.add_request(req("r2", range(100, 107), arrival=2))
    for _ in range(2):
        out = s.schedule()
        s.update_from_output(out, {rid: [1] for rid in out.num_scheduled_tokens})
    return s


def test_swap_out_keeps_progress_and_copies_computed_blocks_to_host():
    s = _swap_setup()
    r2_blocks = s.kv.block_ids("r2")
    out = s.schedule()  # r1 needs a 3rd block -> r2 (tail) is swapped out
    assert out.preempted_req_ids == {"r2"}
    assert out.blocks_to_swap_out == [(r2_blocks[0], 0), (r2_blocks[1], 1)]
    r2 = s.get_request("r2")
    assert r2.status is RequestStatus.SWAPPED and r2.num_computed_tokens == 8
    assert [r.request_id for r in s.swapped] == ["r2"] and len(s.waiting) == 0
    st = s.stats()
    assert st.num_swapped == 1 and st.num_swap_outs == 1 and st.num_free_host_blocks == 2
    s.update_from_output(out, {"r1": [1]})
    s.abort_request("r1")
    out = s.schedule()  # back in: 2 blocks copied in + 1 for position 8
    (c,) = out.cached_requests
    assert c.resumed and c.num_computed_tokens == 8 and len(c.new_block_ids) == 3
    assert c.new_token_ids == r2.output_token_ids
    assert out.blocks_to_swap_in == [(c.new_block_ids[0], 0), (c.new_block_ids[1], 1)]
    assert out.num_scheduled_tokens == {"r2": 1}
    s.update_from_output(out, {"r2": [1]})
    st = s.stats()
    assert st.num_swapped == 0 and st.num_swap_ins == 1 and st.num_free_host_blocks == 4
    assert st.num_recomputed_tokens == 0


def test_swapped_requests_resume_before_waiting_ones_are_admitted():
    s = _swap_setup()
    out = s.schedule()
    s.update_from_output(out, {"r1": [1]})
    s.add_request(req("w", [1, 2], arrival=3))  # 1 block would fit, r2 needs 3
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r1": 1}
    assert [r.request_id for r in s.waiting] == ["w"]


def test_swap_falls_back_to_recompute_when_the_host_is_full():
    s = make(
        num_blocks=4,
        enable_prefix_caching=False,
        max_num_batched_tokens=64,
        preemption_mode="swap",
        num_host_blocks=1,
    )
    s.add_request(req("r1", range(7), arrival=1))
    s.add_request(req("r2", range(100, 107), arrival=2))
    for _ in range(3):
        out = s.schedule()
        s.update_from_output(out, {rid: [1] for rid in out.num_scheduled_tokens})
    assert out.preempted_req_ids == {"r2"} and out.blocks_to_swap_out == []
    r2 = s.get_request("r2")
    assert r2.status is RequestStatus.PREEMPTED and r2.num_computed_tokens == 0


@pytest.mark.parametrize("min_tokens, swapped", [(8, True), (9, False)])
def test_auto_swaps_long_victims_and_recomputes_short_ones(min_tokens, swapped):
    s = make(
        num_blocks=4,
        enable_prefix_caching=False,
        max_num_batched_tokens=64,
        preemption_mode="auto",
        num_host_blocks=8,
        auto_swap_min_tokens=min_tokens,
    )
    s.add_request(req("r1", range(7), arrival=1))
    s.add_request(req("r2", range(100, 107), arrival=2))
    for _ in range(3):
        out = s.schedule()
        s.update_from_output(out, {rid: [1] for rid in out.num_scheduled_tokens})
    assert out.preempted_req_ids == {"r2"}  # it had computed 8 tokens
    assert bool(out.blocks_to_swap_out) is swapped
    assert (s.get_request("r2").status is RequestStatus.SWAPPED) is swapped


def test_abort_swapped_request_frees_its_host_blocks():
    s = _swap_setup()
    out = s.schedule()
    assert s.stats().num_free_host_blocks == 2
    assert s.abort_request("r2")
    assert s.stats().num_free_host_blocks == 4 and s.stats().num_swapped == 0
    s.update_from_output(out, {"r1": [1], "r2": [5]})
    assert s.schedule().finished_req_ids == {"r2"}
