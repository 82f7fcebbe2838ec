"""Each policy's order on hand-made queues, victim choice, options and the registry."""

from __future__ import annotations

import math

import pytest

from scheduler_svc.core import (
    Request,
    RequestStatus,
    SchedulerConfig,
    SchedulerConfigError,
    available_policies,
    create_policy,
    create_request_queue,
)
from scheduler_svc.core.policies import DeadlinePolicy, FairSharePolicy, TenantFairQueue
from tests.factories import prompt, request


def r(
    rid,
    n=10,
    priority=0,
    arrival=0.0,
    tenant=None,
    deadline=None,
    out=0,
    computed=0,
    min_tokens=0,
    max_tokens=64,
) -> Request:
    return request(
        rid,
        prompt(n),
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        priority=priority,
        arrival=arrival,
        tenant=tenant,
        deadline=deadline,
        out=[7] * out,
        computed=computed,
    )


def drain(q) -> list[str]:
    out = []
    while q:
        out.append(q.pop().request_id)
    return out


def fill(policy, *reqs):
    q = create_request_queue(policy)
    for x in reqs:
        q.add(x)
    return q


def test_all_policies_registered_and_options_filtered():
    names = available_policies()
    assert names[:2] == ["fcfs", "priority"]
    assert {"sjf", "sjf-aging", "priority-aging", "fair", "deadline"} <= set(names)
    # one option set serves every policy: each takes what it knows, None means default
    opts = {"aging_rate": 5.0, "weights": {"a": 2.0}, "prefill_s_per_token": 1e-3}
    assert create_policy("sjf-aging", **opts).aging_rate == 5.0
    assert create_policy("priority-aging", aging_rate=None).aging_rate == 0.1
    assert create_policy("fair", **opts).weight("a") == 2.0
    assert create_policy("deadline", **opts).prefill_s_per_token == 1e-3
    create_policy("fcfs", **opts)
    with pytest.raises(SchedulerConfigError, match="aging_rate"):
        SchedulerConfig(policy="sjf-aging", policy_options={"aging_rate": -1})
    with pytest.raises(SchedulerConfigError, match="weight"):
        SchedulerConfig(policy="fair", policy_options={"weights": {"a": 0}})


def test_sjf_shortest_remaining_prompt_first():
    q = fill(
        "sjf",
        r("long", 300),
        r("short", 20, arrival=5),
        r("mid", 100, arrival=1),
        r("tie_late", 20, arrival=9),
    )
    # a preempted request recomputes its prompt and its output: 30 + 40 = 70
    q.prepend(r("preempted", 30, out=40, arrival=0.5))
    assert drain(q) == ["short", "tie_late", "preempted", "mid", "long"]


def test_sjf_victim_is_the_one_with_most_prompt_left_then_least_waste():
    p = create_policy("sjf")
    running = [r("a", 100, computed=100, out=5), r("b", 500, computed=200), r("c", 50, computed=50)]
    assert p.select_victim(running) == 1  # 300 prompt tokens left
    decodes = [r("old", 400, arrival=0, computed=400), r("new", 40, arrival=1, computed=40)]
    waste = {"old": 400.0, "new": 40.0}
    assert p.select_victim(decodes, lambda x: waste[x.request_id]) == 1


def test_sjf_aging_waiting_time_buys_rank():
    p = create_policy("sjf-aging", aging_rate=100.0)  # 100 prompt tokens per second waited
    long = r("long", 1000, arrival=0.0)
    early_short = r("early", 10, arrival=5.0)  # 10 + 500 < 1000: still first
    late_short = r("late", 10, arrival=12.0)  # 10 + 1200 > 1000: the long one has aged past it
    assert drain(fill(p, late_short, long, early_short)) == ["early", "long", "late"]
    # the key never changes while waiting: no re-sort needed, at any time
    assert p.key(long) == p.key(long) and not p.aging


def test_priority_and_priority_aging():
    def reqs():
        return [
            r("low_old", priority=5, arrival=0.0),
            r("high_new", priority=0, arrival=40.0),
            r("mid", priority=2, arrival=10.0),
        ]

    assert drain(fill("priority", *reqs())) == ["high_new", "mid", "low_old"]
    # 0.25 levels per second: low_old (5 + 0) beats high_new (0 + 10) and mid (2 + 2.5)
    p = create_policy("priority-aging", aging_rate=0.25)
    assert drain(fill(p, *reqs())) == ["mid", "low_old", "high_new"]


def test_priority_victim_prefers_a_markedly_cheaper_loss_among_equal_priority():
    p = create_policy("priority")
    running = [
        r("cheap_old", priority=1, arrival=0.0),
        r("dear_new", priority=1, arrival=5.0),
        r("important", priority=0, arrival=9.0),
    ]
    waste = {"cheap_old": 1.0, "dear_new": 10.0, "important": 0.1}
    assert p.select_victim(running, lambda x: waste[x.request_id]) == 0
    waste["cheap_old"] = 8.0  # within the tolerance: the latest arrival, as vLLM
    assert p.select_victim(running, lambda x: waste[x.request_id]) == 1
    assert p.select_victim(running) == 1
    assert create_policy("fcfs").select_victim(running, lambda x: waste[x.request_id]) == 2


def test_deadline_edf_then_best_effort_and_hopeless_demoted():
    p = DeadlinePolicy(prefill_s_per_token=0.01, decode_s_per_token=0.1)
    now = [100.0]
    p.clock = lambda: now[0]
    q = fill(
        p,
        r("late", 10, arrival=0, deadline=150.0),
        r("soon", 10, arrival=1, deadline=120.0),
        r("none", 10, arrival=2),
        r("hopeless", 50, arrival=3, deadline=100.2, max_tokens=1),  # needs 0.6 s: cannot
        r("tight", 10, arrival=4, deadline=100.5, max_tokens=1),
    )
    assert [x.request_id for x in q] == ["tight", "soon", "late", "none", "hopeless"]
    assert p.time_left(r("x", 10, max_tokens=3)) == pytest.approx(0.1 + 0.3)
    # time passes: "tight" can no longer make it (needs 0.2 s); refresh demotes it and every
    # queue ordered by the policy re-sorts (the policy's generation changed)
    other = fill(
        p, r("tight2", 10, arrival=4, deadline=100.5, max_tokens=1), r("none2", 10, arrival=5)
    )
    now[0] = 100.35
    assert p.refresh(now[0]) is True and p.num_demoted == 2
    assert drain(q) == ["soon", "late", "none", "hopeless", "tight"]
    assert drain(other) == ["tight2", "none2"]  # best effort: oldest first
    assert p.refresh(now[0]) is False


def test_deadline_victim_best_effort_first_then_latest_deadline():
    p = DeadlinePolicy()
    p.clock = lambda: 0.0
    running = [
        r("d10", deadline=10.0, computed=10),
        r("d50", deadline=50.0, computed=10),
        r("d20", deadline=20.0, computed=10),
    ]
    assert p.select_victim(running) == 1
    running.append(r("none", computed=10))
    assert p.select_victim(running) == 3


def test_fair_queue_serves_the_tenant_furthest_behind_its_weight():
    p = FairSharePolicy(weights={"a": 3.0, "b": 1.0})
    q = create_request_queue(p)
    assert isinstance(q, TenantFairQueue)
    for i in range(3):
        q.add(r(f"a{i}", arrival=i, tenant="a"))
        q.add(r(f"b{i}", arrival=i, tenant="b"))
    q.add(r("a_urgent", arrival=9, tenant="a", priority=-1))
    assert len(q) == 7 and "b1" in q and q.tenants() == {"a": 4, "b": 3}
    done = dict(computed=10, max_tokens=1)  # charged exactly what is scheduled
    p.account([r("x", tenant="a", **done)], [30])  # a: 30 / 3 = 10
    p.account([r("y", tenant="b", **done)], [5])  # b: 5 / 1 = 5
    assert q.peek().request_id == "b0"
    p.account([r("y", tenant="b", **done)], [10])  # b: 15 > 10
    # expected order: each request is charged its expected tokens (10 prompt + 63 more output,
    # max_tokens 64) over its tenant's weight: a 10 -> 34.3 | b 15 -> 88 | a -> 58.7, 83, 107
    assert [x.request_id for x in q][:5] == ["a_urgent", "b0", "a0", "a1", "a2"]
    assert q.pop().request_id == "a_urgent"  # within a tenant: priority first
    # popped (being admitted): its expected cost is pending, so b goes next
    assert p.rank("a") == pytest.approx(10 + 73 / 3)
    assert q.peek().request_id == "b0"
    assert q.remove("b1").request_id == "b1" and q.remove("b1") is None
    assert q.get("a2").request_id == "a2"
    with pytest.raises(ValueError):
        q.add(r("a2", tenant="a"))
    assert sorted(drain(q)) == ["a0", "a1", "a2", "b0", "b2"]
    with pytest.raises(IndexError):
        q.pop()
    assert p.shares() == pytest.approx({"a": 30 / 45, "b": 15 / 45})


def test_fair_new_or_idle_tenant_starts_at_the_minimum_virtual_time():
    p = FairSharePolicy(weights={"a": 1.0, "b": 1.0, "c": 1.0})
    q = create_request_queue(p)
    a = r("a0", tenant="a", computed=10, max_tokens=1)
    q.add(a)
    q.pop()
    a.status = RequestStatus.RUNNING
    p.account([a], [1000])  # a alone for a long time
    b = r("b0", tenant="b", computed=10, max_tokens=1)
    q.add(b)  # b arrives: it starts level with a, with no credit for a's solo run
    assert p.vtime["b"] == pytest.approx(1000.0)
    p.account([a, b], [100, 400])
    a.status = RequestStatus.FINISHED  # a goes idle
    q.pop()
    b.status = RequestStatus.RUNNING
    p.account([b], [600])  # b: 2000
    q.add(r("a1", tenant="a"))  # a returns after idling: lifted to b's 2000, not 1100
    assert p.vtime["a"] == pytest.approx(2000.0)
    assert p.is_active("a") and not p.is_active("c")
    # a tenant that was ahead and went idle keeps its lead (no lift down)
    p.vtime["c"] = 5000.0
    q.add(r("c0", tenant="c"))
    assert p.vtime["c"] == 5000.0


def test_keyed_queue_resorts_when_policy_generation_changes():
    p = create_policy("priority")
    q = fill(p, r("x", priority=1), r("y", priority=2))
    q.get("y").priority = 0
    p.generation += 1
    assert q.peek().request_id == "y"
    assert math.isfinite(p.key(q.peek())[1])
