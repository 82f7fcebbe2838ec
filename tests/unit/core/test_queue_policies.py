"""Waiting queues and scheduling policies: order, prepend, O(1) removal, registry, aging hook."""

from __future__ import annotations

import random

import pytest

from scheduler_svc.core import (
    FIFORequestQueue,
    KeyedRequestQueue,
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
    available_policies,
    create_policy,
    create_request_queue,
    register_policy,
    unregister_policy,
)
from tests.factories import prompt, request


def r(rid: str, priority: int = 0, arrival: float = 0.0, n: int = 1) -> Request:
    return request(rid, prompt(n), max_tokens=4, priority=priority, arrival=arrival)


def ids(q) -> list[str]:
    return [x.request_id for x in q]


def drain(q) -> list[str]:
    out = []
    while q:
        out.append(q.pop().request_id)
    return out


def test_registry_has_fcfs_and_priority():
    assert {"fcfs", "priority"} <= set(available_policies())
    assert isinstance(create_request_queue("fcfs"), FIFORequestQueue)
    assert isinstance(create_request_queue("priority"), KeyedRequestQueue)
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        create_policy("nope")


def test_fcfs_add_pop_prepend():
    q = create_request_queue("fcfs")
    for i in range(4):
        q.add(r(f"r{i}", arrival=10 - i))  # arrival times are ignored: insertion order rules
    q.prepend(r("pre", arrival=99))
    assert q.peek().request_id == "pre"
    assert len(q) == 5 and "r2" in q and "zz" not in q
    assert drain(q) == ["pre", "r0", "r1", "r2", "r3"]
    with pytest.raises(IndexError):
        q.pop()
    assert q.peek() is None


def test_priority_order_and_prepend_keeps_arrival_time():
    q = create_request_queue("priority")
    q.add(r("b", priority=1, arrival=2.0))
    q.add(r("c", priority=1, arrival=3.0))
    q.add(r("urgent", priority=0, arrival=9.0))
    q.prepend(r("preempted", priority=1, arrival=1.0))  # arrived first: goes before b
    q.prepend(r("preempted_late", priority=1, arrival=2.5))  # between b and c
    assert ids(q) == ["urgent", "preempted", "b", "preempted_late", "c"]
    assert drain(q) == ["urgent", "preempted", "b", "preempted_late", "c"]


def test_priority_ties_fifo_and_prepend_wins_ties():
    q = create_request_queue("priority")
    q.add(r("x", arrival=1.0))
    q.add(r("y", arrival=1.0))
    q.prepend(r("p", arrival=1.0))
    assert drain(q) == ["p", "x", "y"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_remove_from_anywhere_is_lazy_and_consistent(policy):
    q = create_request_queue(policy)
    rng = random.Random(0)
    reqs = [r(f"r{i}", priority=rng.randint(0, 3), arrival=float(i)) for i in range(500)]
    for x in reqs:
        q.add(x)
    removed = rng.sample([x.request_id for x in reqs], 400)
    for rid in removed:
        assert q.remove(rid).request_id == rid
    assert q.remove("r-none") is None
    assert q.remove(removed[0]) is None  # twice
    assert len(q) == 100
    expected = [x for x in reqs if x.request_id not in removed]
    if policy == "priority":
        expected.sort(key=lambda x: (x.priority, x.arrival_time))
    assert ids(q) == [x.request_id for x in expected]
    assert drain(q) == [x.request_id for x in expected]
    # no tombstones are left behind once the queue is empty
    container = q._dq if policy == "fcfs" else q._heap
    assert len(container) == 0


def test_duplicate_add_is_refused():
    q = create_request_queue("fcfs")
    q.add(r("a"))
    with pytest.raises(ValueError):
        q.add(r("a"))


def test_get_and_readd_after_remove():
    q = create_request_queue("priority")
    a = r("a")
    q.add(a)
    assert q.get("a") is a
    q.remove("a")
    assert q.get("a") is None
    q.add(a)
    assert drain(q) == ["a"]


def test_fcfs_victim_is_tail_priority_victim_is_max_key():
    running = [r("a", 0, 1.0), r("b", 3, 2.0), r("c", 3, 0.5), r("d", 1, 9.0)]
    assert create_policy("fcfs").select_victim(running) == 3
    assert create_policy("priority").select_victim(running) == 1  # (3, 2.0) is the max


def test_custom_policy_plugs_in_by_name_with_aging_hook():
    @register_policy
    class ShortestPromptFirst(SchedulingPolicy):
        name = "test_sjf"
        aging = True
        refreshes = 0

        def key(self, request):
            return (len(request.prompt_token_ids), request.arrival_time)

        def refresh(self, now):
            type(self).refreshes += 1
            return True  # ask the queue to re-sort every step

    try:
        assert "test_sjf" in available_policies()
        s = Scheduler(
            SchedulerConfig(
                policy="test_sjf", max_num_seqs=1, block_size=4, num_blocks=32, max_model_len=64
            )
        )
        s.add_request(r("long", n=9, arrival=0.0))
        s.add_request(r("short", n=2, arrival=1.0))
        out = s.schedule()
        assert list(out.num_scheduled_tokens) == ["short"]
        assert ShortestPromptFirst.refreshes == 1
        assert isinstance(s.waiting, KeyedRequestQueue)
    finally:
        unregister_policy("test_sjf")
    assert "test_sjf" not in available_policies()


def test_schedulers_share_one_waiting_queue():
    q = create_request_queue("fcfs")
    cfg = SchedulerConfig(max_num_seqs=1, block_size=4, num_blocks=16, max_model_len=64)
    s1, s2 = Scheduler(cfg, waiting_queue=q), Scheduler(cfg, waiting_queue=q)
    s1.add_request(r("a", n=3))
    s1.add_request(r("b", n=3))
    s2.add_request(r("c", n=3))
    assert len(q) == 3
    out1, out2 = s1.schedule(), s2.schedule()
    assert list(out1.num_scheduled_tokens) == ["a"]
    assert list(out2.num_scheduled_tokens) == ["b"]
    assert s1.stats().num_waiting == s2.stats().num_waiting == 1
    with pytest.raises(ValueError, match="same policy"):
        Scheduler(SchedulerConfig(policy="priority"), waiting_queue=q)
