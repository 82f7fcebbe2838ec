"""Hand-computed scheduler steps: budget, chunking, prefix hits, preemption, diff contents."""

from __future__ import annotations

import functools
import itertools

from scheduler_svc.core import (
    FinishReason,
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerOutput,
)
from tests.factories import request, scheduler_factory

_tok = itertools.count(1000)


make = scheduler_factory(
    max_num_batched_tokens=16,
    max_num_seqs=8,
    block_size=4,
    num_blocks=64,
    watermark=0.0,
    max_model_len=256,
)

req = functools.partial(request, max_tokens=50)


def sample_for(s: Scheduler, out: SchedulerOutput) -> dict[str, list[int]]:
    """One new token for every request whose known tokens are now all computed."""
    sampled = {}
    for rid in out.num_scheduled_tokens:
        r = s.get_request(rid)
        done = r is not None and r.num_computed_tokens == r.num_tokens
        sampled[rid] = [next(_tok)] if done else []
    return sampled


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.update_from_output(out, sample_for(s, out))
    return out


def cached_ids(out: SchedulerOutput) -> list[str]:
    return [c.request_id for c in out.cached_requests]


def new_ids(out: SchedulerOutput) -> list[str]:
    return [n.request_id for n in out.new_requests]


def waiting_ids(s: Scheduler) -> list[str]:
    return [r.request_id for r in s.waiting]


# ---- the seeds' worked example ----------------------------------------------------------------


def test_worked_example_budget_16_decode_1_prefill_5_cached_8_gets_10():
    s = make(max_num_batched_tokens=16, block_size=4)
    prefix = list(range(100, 108))  # 8 tokens = 2 full blocks
    s.add_request(req("P", prefix, max_tokens=1, arrival=0))  # populates the prefix cache
    s.add_request(req("A", range(200, 204), arrival=1))  # will be a running decode
    s.add_request(req("B", range(300, 309), arrival=2))  # 9 tokens: gets 4 now, 5 left
    out0 = step(s)
    assert out0.num_scheduled_tokens == {"P": 8, "A": 4, "B": 4}
    assert out0.total_num_scheduled_tokens == 16
    assert s.get_request("P") is None  # finished (max_tokens=1); its full blocks stay cached

    s.add_request(req("C", prefix + list(range(400, 420)), arrival=3))  # 8 cached + 20 new
    out1 = s.schedule()
    assert out1.num_scheduled_tokens == {"A": 1, "B": 5, "C": 10}
    assert out1.total_num_scheduled_tokens == 16
    assert out1.finished_req_ids == {"P"}
    (c,) = out1.new_requests
    assert c.request_id == "C"
    assert c.num_computed_tokens == 8  # the prefix hit, free of budget
    assert len(c.block_ids) == 5  # 8 cached + 10 new tokens -> 18 tokens -> 5 blocks
    assert s.get_request("C").num_computed_tokens == 18
    st = s.stats()
    assert st.prefix_cache_hits == 8
    assert st.prefix_cache_queries == 8 + 4 + 9 + 28


# ---- chunked prefill and budget ---------------------------------------------------------------


def test_running_first_then_waiting_and_chunking():
    s = make(max_num_batched_tokens=10)
    s.add_request(req("a", range(25)))
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 10}
    s.add_request(req("b", range(100, 103)))
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 10}  # running first takes the whole budget
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 5, "b": 3}
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}


def test_long_prefill_token_threshold_caps_one_request_chunk():
    s = make(max_num_batched_tokens=32, long_prefill_token_threshold=6)
    s.add_request(req("a", range(20)))
    s.add_request(req("b", range(100, 104)))
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 6, "b": 4}
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 6, "b": 1}


def test_max_num_seqs_limits_admission():
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", [i + 1]))
    out = step(s)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert waiting_ids(s) == ["r2"]


def test_chunked_off_skips_too_long_prompt_without_blocking_shorter_one():
    s = make(max_num_batched_tokens=12, enable_chunked_prefill=False)
    s.add_request(req("R", range(5), max_tokens=3))
    assert step(s).num_scheduled_tokens == {"R": 5}
    s.add_request(req("long", range(100, 112), arrival=1))  # 12 tokens: fits only a whole step
    s.add_request(req("short", range(200, 203), max_tokens=3, arrival=2))
    out = step(s)
    # R decodes 1 -> 11 left: 'long' (12) cannot run whole now and is skipped, 'short' runs
    assert out.num_scheduled_tokens == {"R": 1, "short": 3}
    assert waiting_ids(s) == ["long"]  # still at the head
    out = step(s)
    assert out.num_scheduled_tokens == {"R": 1, "short": 1}
    while "long" not in out.num_scheduled_tokens:
        out = step(s)
    assert out.num_scheduled_tokens["long"] == 12  # whole, never chunked


def test_pool_full_stops_admission_even_for_a_smaller_request_behind():
    s = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    s.add_request(req("a", range(12)))  # 3 blocks
    step(s)
    s.add_request(req("big", range(100, 108), arrival=1))  # needs 2 blocks, 1 free
    s.add_request(req("small", [7], arrival=2))  # would fit
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 1}
    assert waiting_ids(s) == ["big", "small"]


def test_watermark_is_ignored_when_nothing_runs():
    s = make(num_blocks=10, block_size=4, watermark=0.2, max_num_batched_tokens=64)  # keep 2
    s.add_request(req("a", range(36)))  # 9 blocks: 9 + 2 > 10, but nothing else runs
    assert step(s).num_scheduled_tokens == {"a": 36}


def test_watermark_keeps_headroom_when_admitting_next_to_running_requests():
    s = make(num_blocks=10, block_size=4, watermark=0.2, max_num_batched_tokens=64)  # keep 2
    s.add_request(req("a", range(24)))  # 6 blocks
    step(s)
    s.add_request(req("b", range(100, 108)))  # 2 blocks; a takes a 7th -> 3 free, 3 - 2 < 2
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 1}
    s.abort_request("b")
    s.add_request(req("c", range(100, 104)))  # 1 block: 3 - 1 >= 2 -> admitted
    assert step(s).num_scheduled_tokens == {"a": 1, "c": 4}
    # running requests themselves may use the headroom
    s2 = make(num_blocks=10, block_size=4, watermark=0.2, max_num_batched_tokens=64)
    a = req("a", range(36), max_tokens=50)
    s2.add_request(a)
    outs = [step(s2) for _ in range(5)]
    assert all(o.num_scheduled_tokens.get("a") for o in outs)  # uses all 10 blocks
    assert s2.stats().num_preemptions == 0
    # 41 tokens would need an 11th block to compute the next one: it ends with LENGTH
    assert a.finish_reason is FinishReason.LENGTH and len(a.output_token_ids) == 5


# ---- prefix cache -----------------------------------------------------------------------------


def test_prefix_hit_across_requests_is_whole_blocks_and_spends_no_budget():
    s = make(max_num_batched_tokens=4, block_size=4)
    s.add_request(req("a", range(10), max_tokens=1))
    for _ in range(3):
        step(s)  # 4 + 4 + 2 tokens, then it finishes
    assert not s.has_unfinished_requests()
    s.add_request(req("b", list(range(8)) + [50, 51, 52, 53]))
    out = s.schedule()
    (b,) = out.new_requests
    assert b.num_computed_tokens == 8  # blocks 0 and 1 of 'a'; block 2 of 'a' was partial
    assert out.num_scheduled_tokens == {"b": 4}  # the 8 cached tokens cost nothing
    assert out.total_num_scheduled_tokens == 4


def test_prefix_shared_within_one_step_by_requests_admitted_together():
    # the first request's step fills the blocks; the worker writes K/V before attention reads
    # it, so the second one admitted in the same step already reuses them (as in vLLM)
    s = make(block_size=4, max_num_batched_tokens=64)
    s.add_request(req("a", list(range(8)) + [50]))
    s.add_request(req("b", list(range(8)) + [60]))
    out = s.schedule()
    a, b = out.new_requests
    assert (a.num_computed_tokens, b.num_computed_tokens) == (0, 8)
    assert b.block_ids[:2] == a.block_ids[:2]
    assert out.num_scheduled_tokens == {"a": 9, "b": 1}


def test_prefix_hit_is_capped_so_the_last_token_is_computed():
    s = make(block_size=4)
    s.add_request(req("a", range(8), max_tokens=1))
    step(s)
    s.add_request(req("b", range(8)))  # identical prompt: 2 cached blocks, but only 1 usable
    out = s.schedule()
    assert out.new_requests[0].num_computed_tokens == 4
    assert out.num_scheduled_tokens == {"b": 4}


def test_shared_blocks_are_ref_counted_and_freed_once_unused():
    s = make(block_size=4, num_blocks=16)
    s.add_request(req("a", range(8), max_tokens=1))
    step(s)
    s.add_request(req("b", list(range(8)) + [9]))
    s.add_request(req("c", list(range(8)) + [10]))
    out = step(s)
    blocks_b = out.new_requests[0].block_ids
    blocks_c = out.new_requests[1].block_ids
    assert blocks_b[:2] == blocks_c[:2]  # shared prefix blocks
    assert blocks_b[2] != blocks_c[2]
    shared = s.kv.pool.blocks[blocks_b[0]]
    assert shared.ref_cnt == 2
    s.abort_request("b")
    assert shared.ref_cnt == 1
    s.abort_request("c")
    assert shared.ref_cnt == 0 and shared.block_hash is not None  # cached but free
    assert s.stats().kv_usage == 0.0


def test_decode_filled_blocks_are_cached_for_later_requests():
    s = make(block_size=4)
    s.add_request(req("a", range(6), max_tokens=8))
    outputs = []
    while s.has_unfinished_requests():
        out = s.schedule()
        sampled = sample_for(s, out)
        outputs += sampled.get("a", [])
        s.update_from_output(out, sampled)
    full = list(range(6)) + outputs  # 14 tokens; positions 0..12 computed -> 3 full blocks
    s.add_request(req("b", full + [1, 2, 3]))
    out = s.schedule()
    assert out.new_requests[0].num_computed_tokens == 12  # block 2 holds decode outputs only


def test_lru_eviction_order_of_cached_free_blocks():
    s = make(block_size=4, num_blocks=6, max_num_batched_tokens=64)
    s.add_request(req("a", range(8), max_tokens=1))  # a0 a1 (full, cached)
    step(s)
    s.add_request(req("b", range(100, 108), max_tokens=1))  # b0 b1, freed after a's
    step(s)
    step(s)  # report finishes
    pool = s.kv.pool
    cached = [b.block_id for b in pool.free_queue if b.block_hash is not None]
    # freed in reverse: a1, a0, then b1, b0 -> evicted in that order
    a_blocks = cached[:2]
    b_blocks = cached[2:]
    assert len(cached) == 4
    # a new 12-token prompt needs 3 blocks: 2 empty ones, then a's tail block a1
    s.add_request(req("x", range(500, 512), max_tokens=1))
    out = s.schedule()
    taken = out.new_requests[0].block_ids
    assert a_blocks[0] in taken and a_blocks[1] not in taken
    assert not set(b_blocks) & set(taken)
    s.update_from_output(out, sample_for(s, out))
    assert all(pool.blocks[i].block_hash is not None for i in b_blocks)
    assert pool.blocks[a_blocks[1]].block_hash is not None  # a's first block survived
    s.add_request(req("a2", list(range(8)) + [1]))
    out = s.schedule()
    assert out.new_requests[0].num_computed_tokens == 4  # only a's first block is left


# ---- preemption -------------------------------------------------------------------------------


def _two_full_requests(policy: str = "fcfs") -> Scheduler:
    # 4 blocks of 4; r1, r2 have 7-token prompts (2 blocks each) -> the pool is full
    s = make(
        num_blocks=4,
        block_size=4,
        max_num_batched_tokens=64,
        policy=policy,
        enable_prefix_caching=False,
    )
    s.add_request(req("r1", range(7), arrival=1))
    s.add_request(req("r2", range(100, 107), arrival=2))
    step(s)  # both prefill 7 -> 8 tokens each
    step(s)  # decode position 7, still in block 1 -> 9 tokens each
    return s


def test_fcfs_victim_is_the_tail_of_running_and_returns_to_head_of_waiting():
    s = _two_full_requests()
    s.add_request(req("w", [1, 2], arrival=3))
    out = s.schedule()  # r1 needs a 3rd block: none free -> preempt r2 (tail)
    assert out.preempted_req_ids == {"r2"}
    assert out.num_scheduled_tokens == {"r1": 1}
    assert out.new_requests == []  # no admission in a step that preempted
    assert waiting_ids(s) == ["r2", "w"]  # preempted goes to the head
    r2 = s.get_request("r2")
    assert r2.status is RequestStatus.PREEMPTED and r2.num_computed_tokens == 0
    assert s.stats().num_preemptions == 1
    s.update_from_output(out, sample_for(s, out))
    out = s.schedule()
    # r2 (10 tokens, 3 blocks) cannot be admitted with 1 free block: admission stops, 'w'
    # behind it waits too
    assert out.num_scheduled_tokens == {"r1": 1}
    assert waiting_ids(s) == ["r2", "w"]


def test_preempted_request_resumes_with_full_block_table_and_its_outputs():
    s = _two_full_requests()
    out = step(s)
    assert out.preempted_req_ids == {"r2"}
    r2 = s.get_request("r2")
    outputs_before = list(r2.output_token_ids)
    assert len(outputs_before) == 2
    s.abort_request("r1")
    out = s.schedule()
    (c,) = out.cached_requests
    assert c.request_id == "r2" and c.resumed
    assert c.new_token_ids == outputs_before
    assert c.num_computed_tokens == 0  # recompute from scratch (no prefix caching here)
    assert len(c.new_block_ids) == 3  # the whole table: 9 tokens -> 3 blocks
    assert out.num_scheduled_tokens == {"r2": 9}
    assert out.new_requests == []
    s.update_from_output(out, sample_for(s, out))
    assert s.stats().num_recomputed_tokens == 8  # positions 0..7 had been computed before


def test_recompute_after_preemption_reuses_prefix_cache_and_counts_only_the_rest():
    s = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    s.add_request(req("r1", range(7), arrival=1))
    s.add_request(req("r2", range(100, 107), arrival=2))
    step(s)
    step(s)
    out = step(s)
    assert out.preempted_req_ids == {"r2"}
    s.abort_request("r1")
    out = s.schedule()
    (c,) = out.cached_requests
    # r1's new block evicted r2's tail block (LRU); r2's first block was still cached
    assert c.resumed and c.num_computed_tokens == 4
    assert out.num_scheduled_tokens == {"r2": 5}
    s.update_from_output(out, sample_for(s, out))
    assert s.stats().num_recomputed_tokens == 4  # positions 4..7 again; 0..3 came from cache


def test_priority_victim_is_max_priority_then_latest_arrival_and_gives_back_its_budget():
    s = make(
        num_blocks=6,
        block_size=4,
        max_num_batched_tokens=64,
        policy="priority",
        enable_prefix_caching=False,
    )
    s.add_request(req("x", range(6), priority=5, arrival=1.0))  # least important, admitted first
    step(s)  # x: prefill 6 -> 7 tokens
    s.add_request(req("y", range(100, 108), priority=0, arrival=2.0))
    s.add_request(req("z", range(200, 207), priority=0, arrival=3.0))
    out = step(s)  # x decodes pos 6; y, z prefill -> pool full (2 + 2 + 2 blocks)
    assert out.num_scheduled_tokens == {"x": 1, "y": 8, "z": 7}
    assert [r.request_id for r in s.running] == ["x", "y", "z"]
    out = s.schedule()
    # x is scheduled first (pos 7, no new block); y needs a 3rd block -> victim max(priority,
    # arrival) = x, which was already scheduled this step: its token and its entry go back
    assert out.preempted_req_ids == {"x"}
    assert out.num_scheduled_tokens == {"y": 1, "z": 1}
    assert out.total_num_scheduled_tokens == 2
    assert cached_ids(out) == ["y", "z"]
    assert [r.request_id for r in s.running] == ["y", "z"]


def test_victim_given_back_does_not_leave_the_block_it_would_have_filled_cached():
    s = make(num_blocks=6, block_size=4, max_num_batched_tokens=64, policy="priority")
    s.add_request(req("x", range(6), priority=5, arrival=1.0))
    step(s)
    s.add_request(req("y", range(100, 108), priority=0, arrival=2.0))
    s.add_request(req("z", range(200, 207), priority=0, arrival=3.0))
    step(s)
    x = s.get_request("x")
    out = s.schedule()  # x's token at position 7 would fill its block 1; x is taken back
    assert out.preempted_req_ids == {"x"}
    probe = Request("probe", x.all_token_ids + [1], SamplingParams())
    assert len(s.kv.find_cached_prefix(probe)) == 1  # block 0 only: block 1 never computed


def test_priority_victim_tie_on_priority_is_the_later_arrival():
    s = make(
        num_blocks=4,
        block_size=4,
        max_num_batched_tokens=64,
        policy="priority",
        enable_prefix_caching=False,
    )
    s.add_request(req("late", range(100, 107), priority=1, arrival=2.0))
    s.add_request(req("early", range(7), priority=1, arrival=1.0))
    step(s)
    assert [r.request_id for r in s.running] == ["early", "late"]
    step(s)
    out = s.schedule()
    assert out.preempted_req_ids == {"late"}


def test_request_that_is_its_own_victim_is_preempted_and_later_ones_still_run():
    s = make(
        num_blocks=4,
        block_size=4,
        max_num_batched_tokens=64,
        policy="priority",
        enable_prefix_caching=False,
    )
    s.add_request(req("low", range(7), priority=9, arrival=1.0))
    step(s)  # low: 8 tokens (2 blocks)
    s.add_request(req("high", range(100, 107), priority=0, arrival=2.0))
    step(s)  # low decodes pos 7; high prefills 7 -> both 2 blocks, pool full
    out = s.schedule()  # low needs block 3 and is itself the max -> preempted, high continues
    assert out.preempted_req_ids == {"low"}
    assert out.num_scheduled_tokens == {"high": 1}


def test_priority_preempted_request_keeps_its_arrival_time_in_waiting():
    s = make(
        num_blocks=4,
        block_size=4,
        max_num_batched_tokens=64,
        policy="priority",
        enable_prefix_caching=False,
        max_num_seqs=2,
    )
    s.add_request(req("r1", range(7), priority=1, arrival=1.0))
    s.add_request(req("r2", range(100, 107), priority=1, arrival=2.0))
    step(s)
    step(s)
    s.add_request(req("later_same", [5, 6], priority=1, arrival=3.0))
    s.add_request(req("later_urgent", [7, 8], priority=0, arrival=4.0))
    out = step(s)
    assert out.preempted_req_ids == {"r2"}
    assert waiting_ids(s) == ["later_urgent", "r2", "later_same"]


def test_fcfs_preempted_goes_before_everything_waiting():
    s = _two_full_requests()
    s.add_request(req("w1", [1], arrival=0.5))  # even an earlier arrival stays behind
    out = step(s)
    assert out.preempted_req_ids == {"r2"}
    assert waiting_ids(s) == ["r2", "w1"]


def test_several_preemptions_in_one_step_keep_the_victims_order_at_the_head():
    s = make(
        num_blocks=4,
        block_size=4,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=8,
        enable_prefix_caching=False,
    )
    s.add_request(req("a", range(16), arrival=0))
    s.add_request(req("b", range(100, 103), arrival=1))
    s.add_request(req("c", range(200, 203), arrival=2))
    s.add_request(req("w", [1], arrival=3))
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 8, "b": 3, "c": 3}  # pool full, w waits
    out = s.schedule()  # a's next chunk needs 2 blocks: preempt c, then b
    assert out.preempted_req_ids == {"b", "c"}
    assert out.num_scheduled_tokens == {"a": 8}
    assert waiting_ids(s) == ["b", "c", "w"]


# ---- the diff ---------------------------------------------------------------------------------


def test_diff_new_once_then_only_new_block_ids():
    s = make(block_size=4, max_num_batched_tokens=64)
    s.add_request(req("a", range(6)))
    out = step(s)
    assert new_ids(out) == ["a"] and out.new_requests[0].block_ids == [0, 1]
    out = step(s)  # computes position 6 (block 1)
    assert cached_ids(out) == ["a"]
    assert out.cached_requests[0].new_block_ids == []
    assert out.cached_requests[0].num_computed_tokens == 6
    out = step(s)  # position 7, still block 1
    assert out.cached_requests[0].new_block_ids == []
    out = step(s)  # position 8 -> block 2
    assert out.cached_requests[0].new_block_ids == [2]
    assert not out.cached_requests[0].resumed


def test_step_ids_increase_and_finished_ids_are_reported_next_step():
    s = make()
    s.add_request(req("a", [1, 2, 3], max_tokens=1))
    out0 = s.schedule()
    outs = s.update_from_output(out0, {"a": [9]})
    assert outs[0].finished and outs[0].new_token_ids == [9]
    out1 = s.schedule()
    assert out1.step_id == out0.step_id + 1
    assert out1.finished_req_ids == {"a"}
    assert s.schedule().finished_req_ids == set()


def test_migrated_request_is_prefilled_over_prompt_and_output():
    s = make(max_num_batched_tokens=64)
    r = req("m", [1, 2, 3], max_tokens=4)
    r.output_token_ids = [7, 8]
    s.add_request(r)
    out = s.schedule()
    (n,) = out.new_requests
    assert n.output_token_ids == [7, 8] and n.prompt_token_ids == [1, 2, 3]
    assert out.num_scheduled_tokens == {"m": 5}
    s.update_from_output(out, {"m": [9]})
    out = s.schedule()
    res = s.update_from_output(out, {"m": [10]})
    assert res[0].finish_reason is not None  # 4 outputs in all: 7, 8, 9, 10
    assert r.output_token_ids == [7, 8, 9, 10]


def test_partial_prefill_output_is_ignored_and_missing_entries_are_fine():
    s = make(max_num_batched_tokens=4)
    s.add_request(req("a", range(6)))
    out = s.schedule()
    assert s.update_from_output(out, {"a": [5]}) == []  # partial prefill: token discarded
    assert s.get_request("a").output_token_ids == []
    out = s.schedule()
    assert s.update_from_output(out, {}) == []  # nothing reported: nothing appended


def test_stats_keys_and_dict_access():
    s = make()
    s.add_request(req("a", [1, 2, 3], max_tokens=2))
    step(s)
    step(s)
    st = s.stats()
    for key in (
        "num_running",
        "num_waiting",
        "num_preemptions",
        "kv_usage",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_recomputed_tokens",
        "num_free_blocks",
        "num_total_blocks",
        "num_steps",
        "num_prefill_tokens",
        "num_decode_tokens",
    ):
        assert st[key] == getattr(st, key)
    assert dict(st.as_dict())["num_steps"] == 2
    assert st.num_prefill_tokens == 3 and st.num_decode_tokens == 1
    assert st.num_total_blocks == 64 and st.num_free_blocks == 64 and st.kv_usage == 0.0
    assert {name: getattr(st, name) for name in st.__slots__} == st.as_dict()
