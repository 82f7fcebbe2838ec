"""adopt_request: a new leader takes over the rows a worker still holds, without recompute."""

from __future__ import annotations

import functools

import pytest

from scheduler_svc.core import RequestRejected, RequestStatus, Scheduler
from tests.factories import prompt, request, scheduler_factory

make = scheduler_factory(
    max_num_batched_tokens=32,
    max_num_seqs=4,
    block_size=4,
    num_blocks=16,
    watermark=0.0,
    max_model_len=64,
    enable_prefix_caching=False,
)
req = functools.partial(request, max_tokens=20)


def check_pool(s: Scheduler) -> None:
    s.kv.pool.check_invariants()
    st = s.stats()
    assert st.num_free_blocks + st.num_used_blocks == st.num_total_blocks


def test_adopted_decode_is_sent_as_new_with_its_table_and_computes_one_token():
    s = make()
    r = req("a", prompt(10), out=[50, 51])  # 12 tokens, 11 of them in the worker's KV
    s.adopt_request(r, [7, 3, 11], 11)
    assert r.status is RequestStatus.RUNNING and s.stats().num_used_blocks == 3
    out = s.schedule()
    [new] = out.new_requests
    assert (new.request_id, new.block_ids, new.num_computed_tokens) == ("a", [7, 3, 11], 11)
    assert new.prompt_token_ids == prompt(10) and new.output_token_ids == [50, 51]
    assert out.num_scheduled_tokens == {"a": 1} and not out.cached_requests
    s.update_from_output(out, {"a": [52]})
    out = s.schedule()  # known to the worker now: a plain running entry
    assert not out.new_requests and [c.request_id for c in out.cached_requests] == ["a"]
    assert out.cached_requests[0].new_block_ids == [0]  # token 12 starts a fourth block
    check_pool(s)


def test_table_entries_beyond_the_computed_tokens_stay_free():
    s = make()
    s.adopt_request(req("a", prompt(9)), [5, 6, 7, 8], 5)  # 5 tokens: blocks 5 and 6
    assert s.kv.block_ids("a") == [5, 6] and s.stats().num_used_blocks == 2
    out = s.schedule()
    assert out.new_requests[0].block_ids == [5, 6, 0]  # room for tokens 5..8 allocated anew
    assert out.num_scheduled_tokens == {"a": 4}
    check_pool(s)


def test_a_block_two_adopted_requests_hold_is_shared_and_freed_by_the_last():
    s = make()
    s.adopt_request(req("a", prompt(10)), [2, 3, 4], 9)
    s.adopt_request(req("b", prompt(10)), [2, 3, 9], 9)
    assert s.kv.pool.blocks[2].ref_cnt == 2 and s.stats().num_used_blocks == 4
    s.abort_request("a")
    assert s.kv.pool.blocks[2].ref_cnt == 1 and s.stats().num_used_blocks == 3
    s.abort_request("b")
    assert s.stats().num_used_blocks == 0 and s.stats().kv_usage == 0.0
    check_pool(s)


@pytest.mark.parametrize(
    "table, computed, words",
    [
        ([1, 16], 5, "outside"),
        ([1, -1], 5, "outside"),
        ([1, 1], 5, "twice"),
        ([1], 5, "need 2 blocks"),
        ([1, 2, 3], 9, "at most 8"),
        ([1, 2], -1, "not -1"),
    ],
)
def test_an_impossible_table_or_count_is_refused_with_a_sentence(table, computed, words):
    s = make()
    with pytest.raises(ValueError, match=words):
        s.adopt_request(req("a", prompt(9)), table, computed)
    assert not s.running and s.stats().num_used_blocks == 0


def test_a_block_of_a_request_this_scheduler_placed_cannot_be_claimed():
    s = make()
    s.add_request(req("x", prompt(5)))
    s.schedule()
    held = s.kv.block_ids("x")
    with pytest.raises(ValueError, match="placed itself"):
        s.adopt_request(req("a", prompt(9)), [held[0], 9], 5)
    assert s.get_request("a") is None and s.stats().num_used_blocks == len(held)
    check_pool(s)


def test_adoption_respects_max_num_seqs_and_unique_ids():
    s = make(max_num_seqs=2)
    s.adopt_request(req("a", prompt(3)), [0], 2)
    with pytest.raises(ValueError, match="already in flight"):
        s.adopt_request(req("a", prompt(3)), [1], 2)
    s.adopt_request(req("b", prompt(3)), [1], 2)
    with pytest.raises(ValueError, match="max_num_seqs=2"):
        s.adopt_request(req("c", prompt(3)), [2], 2)
    with pytest.raises(RequestRejected):  # could never run here
        s.adopt_request(req("d", prompt(64)), [3], 2)


def test_adopted_request_runs_to_its_finish_and_leaves_every_block_free():
    s = make()
    s.adopt_request(req("a", prompt(6), max_tokens=3, out=[40]), [4, 5], 6)
    for tok in (41, 42):
        out = s.schedule()
        assert out.num_scheduled_tokens == {"a": 1}
        s.update_from_output(out, {"a": [tok]})
    assert s.schedule().finished_req_ids == {"a"}
    assert not s.has_unfinished_requests() and s.stats().kv_usage == 0.0
    check_pool(s)


def test_adopted_blocks_get_no_prefix_cache_entries_and_a_claimed_cached_block_loses_its():
    s = make(enable_prefix_caching=True)
    s.add_request(req("x", prompt(9), max_tokens=1))
    s.update_from_output(s.schedule(), {"x": [70]})
    s.schedule()  # x finished: its two full blocks stay cached, free
    cached = {b.block_id for b in s.kv.pool.cached.values()}
    assert len(cached) == 2
    claimed = min(cached)
    s.adopt_request(req("a", prompt(9, start=20)), [claimed, 12, 13], 8)
    assert claimed not in {b.block_id for b in s.kv.pool.cached.values()}
    out = s.schedule()  # computing token 8 fills no block; nothing of a's is registered
    assert out.new_requests[0].block_ids == [claimed, 12, out.new_requests[0].block_ids[2]]
    assert {b.block_id for b in s.kv.pool.cached.values()} == cached - {claimed}
    s.update_from_output(out, {"a": [71]})
    s.abort_request("a")
    s.schedule()
    assert s.stats().kv_usage == 0.0
    check_pool(s)


def test_adopted_request_preempted_before_it_was_sent_comes_back_as_new():
    s = make(num_blocks=4, max_num_batched_tokens=8)
    s.adopt_request(req("a", prompt(8), out=[9], arrival=0.0), [0, 1], 8)  # needs a 3rd block
    s.adopt_request(req("b", prompt(7), out=[8], arrival=1.0), [2, 3], 7)
    out = s.schedule()  # a's block comes from preempting b (fcfs: the latest arrival)
    assert out.preempted_req_ids == {"b"} and [n.request_id for n in out.new_requests] == ["a"]
    assert s.get_request("b").status is RequestStatus.PREEMPTED
    s.update_from_output(out, {"a": [10]})
    s.abort_request("a")
    out = s.schedule()
    [new] = out.new_requests  # b by recompute: the worker never heard of it
    assert (new.request_id, new.num_computed_tokens) == ("b", 0)
    check_pool(s)


def test_adopted_request_swapped_out_before_it_was_sent_is_resumed_as_new():
    s = make(num_blocks=4, max_num_batched_tokens=8, preemption_mode="swap", num_host_blocks=8)
    s.adopt_request(req("a", prompt(8), out=[9], arrival=0.0), [0, 1], 8)
    s.adopt_request(req("b", prompt(7), out=[8], arrival=1.0), [2, 3], 7)
    out = s.schedule()
    assert out.preempted_req_ids == {"b"} and out.blocks_to_swap_out == [(2, 0), (3, 1)]
    s.update_from_output(out, {"a": [10]})
    s.abort_request("a")
    out = s.schedule()
    [new] = out.new_requests  # swapped in, its KV kept; sent as new, not as resumed
    assert (new.request_id, new.num_computed_tokens) == ("b", 7) and not out.cached_requests
    assert [h for _, h in out.blocks_to_swap_in] == [0, 1]
    assert new.block_ids[:2] == [d for d, _ in out.blocks_to_swap_in]
    check_pool(s)


def test_adopted_request_given_back_in_its_first_step_is_not_sent():
    s = make(num_blocks=3, max_num_batched_tokens=16, policy="priority")
    s.adopt_request(req("a", prompt(6), out=[1], priority=5), [0, 1], 6)  # fits in block 1
    s.adopt_request(req("b", prompt(4), out=[5], priority=0), [2], 4)  # needs a second block
    out = s.schedule()  # a is scheduled, then preempted for the more important b
    assert out.preempted_req_ids == {"a"}
    assert [n.request_id for n in out.new_requests] == ["b"]
    assert set(out.num_scheduled_tokens) == {"b"} and "a" not in s._worker_known
    check_pool(s)
