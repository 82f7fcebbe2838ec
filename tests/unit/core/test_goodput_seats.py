"""Under goodput a running request that can no longer make its target gives its seat to a
waiting one that can: preempted (recompute or swap) or, with shed_hopeless, ended; the feasible
one meets its deadline, blocks come back exactly, and aging bounds the loser's wait."""

from __future__ import annotations

import pytest

from scheduler_svc.core import FinishReason, Request, RequestStatus, Scheduler, SchedulerConfig
from tests.factories import prompt, request

STEP_S = 0.01  # simulated seconds per step, decode or prefill (prompts here are short)
OPTIONS = {"prefill_s_per_token": 1e-4, "decode_s_per_token": STEP_S}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock, mode: str = "recompute", **options: object) -> Scheduler:
    sched = Scheduler(
        SchedulerConfig(
            policy="goodput",
            policy_options={**OPTIONS, **options},
            max_num_seqs=1,
            num_blocks=64,
            block_size=16,
            num_host_blocks=64,
            preemption_mode=mode,
        )
    )
    sched.policy.clock = clock  # type: ignore[method-assign]
    return sched


def step(sched: Scheduler, clock: Clock, finished: dict[str, float]) -> set[str]:
    out = sched.schedule()
    sampled = {}
    for rid in out.num_scheduled_tokens:
        r = sched.get_request(rid)
        sampled[rid] = [7] if r is not None and r.num_computed_tokens >= r.num_tokens else []
    clock.now += STEP_S
    sched.update_from_output(out, sampled)
    for rid in sampled:
        if rid not in finished and sched.get_request(rid) is None:
            finished[rid] = clock.now
    return out.preempted_req_ids


def job(rid: str, max_tokens: int, arrival: float, deadline: float) -> Request:
    return request(
        rid, prompt(20), max_tokens=max_tokens, arrival=arrival, deadline=deadline, ignore_eos=True
    )


def hog_then_stall(sched: Scheduler, clock: Clock, finished: dict[str, float]) -> Request:
    """A request that makes its deadline when admitted, then a stall of the worker makes it
    hopeless while a feasible request arrives with no seat left (max_num_seqs 1)."""
    hog = job("hog", 30, 0.0, 0.5)
    sched.add_request(hog)
    for _ in range(5):
        step(sched, clock, finished)
    clock.now = 0.4  # 25 tokens left at one step each: done at 0.65 at best
    sched.add_request(job("fresh", 10, 0.4, 0.7))
    return hog


def drain(sched: Scheduler, clock: Clock, finished: dict[str, float]) -> list[str]:
    preempted: list[str] = []
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        preempted += step(sched, clock, finished)
    assert not sched.has_unfinished_requests()
    pool = sched.kv.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks  # no block leaked by the unseating
    assert sched.kv.host_pool.num_free_blocks == sched.kv.host_pool.num_blocks
    return preempted


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_hopeless_running_request_gives_its_seat_to_a_feasible_one(mode):
    clock, finished = Clock(), {}
    sched = make(clock, mode)
    hog = hog_then_stall(sched, clock, finished)
    preempted = drain(sched, clock, finished)
    assert preempted[0] == "hog"
    assert finished["fresh"] <= 0.7  # its deadline, met
    assert finished["fresh"] < finished["hog"]  # the hopeless one went behind it
    assert hog.finish_reason is FinishReason.LENGTH  # demoted, then served: not dropped
    if mode == "swap":
        assert sched.stats().num_swap_outs == 1


def test_hopeless_running_request_is_shed_when_asked():
    clock, finished = Clock(), {}
    sched = make(clock, shed_hopeless=True)
    hog = hog_then_stall(sched, clock, finished)
    out = sched.schedule()
    assert "hog" in out.finished_req_ids and not out.preempted_req_ids
    assert [r.request_id for r in sched.take_shed()] == ["hog"]
    assert hog.finish_reason is FinishReason.SHED and hog.status is RequestStatus.FINISHED
    assert list(out.num_scheduled_tokens) == ["fresh"]
    clock.now += STEP_S
    sched.update_from_output(out, {"fresh": [7]})
    drain(sched, clock, finished)
    assert finished["fresh"] <= 0.7


def test_running_request_that_still_makes_its_deadline_keeps_its_seat():
    clock, finished = Clock(), {}
    sched = make(clock)
    sched.add_request(job("first", 30, 0.0, 5.0))
    step(sched, clock, finished)
    sched.add_request(job("second", 10, 0.01, 5.0))
    assert not drain(sched, clock, finished)
    assert finished["first"] < finished["second"]


def test_an_unseated_request_waits_at_most_the_aging_bound():
    """Feasible requests keep arriving, each unseating the hopeless one again; once it has
    waited max_wait_s since it arrived it keeps its seat and finishes."""
    clock, finished = Clock(), {}
    sched = make(clock, max_wait_s=1.0)
    hog = job("hog", 60, 0.0, 0.3)  # a TTFT-free deadline it cannot make: hopeless at once
    sched.add_request(hog)
    preempted: list[str] = []
    for k in range(60):
        sched.add_request(job(f"s{k}", 4, clock.now, clock.now + 1.0))
        for _ in range(6):
            preempted += step(sched, clock, finished)
    preempted += drain(sched, clock, finished)
    assert preempted.count("hog") >= 1
    assert hog.finish_reason is FinishReason.LENGTH
    # aged at 1.0 s, then its 60 tokens and its recomputed prompt, a step at a time
    assert finished["hog"] <= 1.0 + 62 * STEP_S + 0.1
