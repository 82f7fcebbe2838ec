"""The goodput policy: as many deadlines met as the best serial order, nothing starved, blocks
exact, hopeless requests shed when asked."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest

from scheduler_svc.core import FinishReason, RequestStatus, Scheduler, SchedulerConfig
from scheduler_svc.core.policies import GoodputPolicy
from scheduler_svc.core.remaining_work import OutputLengthPredictor, StepClock, StepFit
from splitserve.sim import SimSettings, TraceRequest
from splitserve.sim.costmodel import StepCostModel
from splitserve.sim.simulator import Simulator, simulate
from tests.factories import prompt, request

# the worker of the eight-request example: a step costs a base plus a price per token,
# so that each request of the case needs about the time the issue gives it alone
COST = StepCostModel(base_s=0.01, per_token_s=1e-4, per_ctx_token_s=0.0, per_seq_s=0.0)
OPTIONS = {
    "prefill_s_per_token": COST.per_token_s,
    "decode_s_per_token": COST.compute_s(1, 0, 1),
}


def serial(policy: str, **options) -> SimSettings:
    """One request at a time: the order is everything."""
    return SimSettings(
        policy=policy,
        policy_options={**OPTIONS, **options},
        max_num_seqs=1,
        max_num_batched_tokens=512,
        num_blocks=512,
    )


def met(policy: str, trace: list[TraceRequest], **options) -> int:
    res = simulate(serial(policy, **options), trace, COST)
    assert not res.stuck
    return sum(1 for r in res.records if r.met_deadline)


def alone_s(tr: TraceRequest) -> float:
    one = TraceRequest(tr.request_id, 0.0, tr.prompt_len, tr.output_len)
    res = simulate(serial("fcfs"), [one], COST)
    return res.records[0].finish or 0.0


def best_order(trace: list[TraceRequest], alone: Callable[[TraceRequest], float] = alone_s) -> int:
    """Exhaustive search: the most deadlines any serial order of the requests meets."""
    jobs = [(alone(tr), tr.deadline or 0.0) for tr in trace]
    best = 0
    for order in itertools.permutations(range(len(jobs))):
        t, on_time = 0.0, 0
        for i in order:
            t += jobs[i][0]
            on_time += t <= jobs[i][1] + 1e-9
        best = max(best, on_time)
        if best == len(jobs):
            break
    return best


def eight_requests() -> list[TraceRequest]:
    return [TraceRequest(f"r{k}", 0.0, 100, 18, deadline=0.25 + 0.05 * k) for k in range(8)]


def random_case(seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    return [
        TraceRequest(
            f"r{k}",
            0.0,
            rng.randint(20, 300),
            rng.randint(4, 30),
            deadline=rng.uniform(0.1, 0.9),
        )
        for k in range(8)
    ]


def test_eight_requests_meet_as_many_deadlines_as_the_best_order():
    trace = eight_requests()
    best = best_order(trace)
    assert best == 3
    assert met("goodput", trace) >= best
    assert met("goodput", trace) >= met("deadline", trace)


def test_seeded_cases_match_exhaustive_search_in_nine_of_ten():
    wins = 0
    for seed in range(10):
        trace = random_case(seed)
        wins += met("goodput", trace) >= best_order(trace)
    assert wins >= 9


def test_demoted_request_waits_at_most_the_aging_bound():
    """A stream of requests with deadlines they can all meet, a little above the worker's
    capacity, and one request without a deadline: it is served within max_wait_s (plus one
    request's service), not after the stream."""
    stream = [TraceRequest(f"s{k}", 0.043 * k, 40, 4, deadline=0.043 * k + 5) for k in range(200)]
    loner = TraceRequest("loner", 0.01, 40, 4)
    trace = sorted([*stream, loner], key=lambda r: r.arrival)

    def wait(max_wait_s: float) -> float:
        res = simulate(serial("goodput", max_wait_s=max_wait_s), trace, COST)
        rec = next(r for r in res.records if r.request_id == "loner")
        assert rec.ttft is not None
        return rec.ttft

    assert wait(1.0) <= 1.0 + 0.1
    assert wait(1000.0) > 5.0  # without the bound it waits for the stream to end


def test_block_accounting_exact_under_preemption():
    settings = SimSettings(
        policy="goodput",
        policy_options=dict(OPTIONS),
        max_num_seqs=16,
        num_blocks=24,
        block_size=16,
        max_model_len=256,
    )
    rng = random.Random(3)
    trace = [
        TraceRequest(
            f"r{k}",
            0.01 * k,
            rng.randint(20, 120),
            rng.randint(20, 100),
            deadline=rng.uniform(0.5, 3),
        )
        for k in range(60)
    ]
    sim = Simulator(settings, trace, COST)
    for sched in sim.schedulers:
        real = sched.schedule

        def checked(sched=sched, real=real):
            out = real()
            pool = sched.kv.pool
            pool.check_invariants()
            assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
            return out

        sched.schedule = checked  # type: ignore[method-assign]
    res = sim.run()
    assert not res.stuck and res.preemptions > 0
    pool = sim.schedulers[0].kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_hopeless_request_is_shed_at_once_when_asked():
    clock = [100.0]
    sched = Scheduler(
        SchedulerConfig(policy="goodput", policy_options={**OPTIONS, "shed_hopeless": True})
    )
    sched.policy.clock = lambda: clock[0]  # type: ignore[method-assign]
    sched.add_request(request("late", prompt(50), max_tokens=20, arrival=99.0, deadline=100.05))
    sched.add_request(request("fine", prompt(50), max_tokens=20, arrival=99.0, deadline=200.0))
    out = sched.schedule()
    shed = sched.take_shed()
    assert [r.request_id for r in shed] == ["late"]
    assert shed[0].finish_reason is FinishReason.SHED
    assert shed[0].status is RequestStatus.FINISHED
    assert "late" in out.finished_req_ids and "late" not in out.num_scheduled_tokens
    assert list(out.num_scheduled_tokens) == ["fine"]
    assert sched.stats().num_shed == 1


def test_hopeless_request_is_demoted_not_shed_by_default():
    clock = [100.0]
    sched = Scheduler(SchedulerConfig(policy="goodput", policy_options=OPTIONS, max_num_seqs=1))
    sched.policy.clock = lambda: clock[0]  # type: ignore[method-assign]
    sched.add_request(request("late", prompt(50), max_tokens=20, arrival=99.0, deadline=100.05))
    sched.add_request(request("fine", prompt(50), max_tokens=20, arrival=99.5, deadline=200.0))
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["fine"] and not sched.take_shed()


def test_victim_is_the_request_whose_loss_costs_no_met_deadline():
    p = GoodputPolicy(**OPTIONS)
    p.clock = lambda: 0.0  # type: ignore[method-assign]
    tight = request("tight", prompt(50), max_tokens=10, deadline=0.2, computed=50)
    loose = request("loose", prompt(50), max_tokens=10, deadline=50.0, computed=50)
    none = request("none", prompt(50), max_tokens=1, computed=50)
    for r in (tight, loose, none):
        r.status = RequestStatus.RUNNING
    p.account([tight, loose, none], [1, 1, 1])
    p.refresh(0.0)
    assert p.select_victim([none, tight, loose]) == 0
    assert p.select_victim([tight, loose]) == 1


def test_output_length_learned_per_tenant_and_error_reported():
    pred = OutputLengthPredictor(min_observations=2)
    for k in range(4):
        r = request(f"d{k}", prompt(30), max_tokens=100, tenant="a")
        assert pred.predict(r) == (100 if k < 2 else 25)  # no history yet: max_tokens
        r.output_token_ids = [1] * 25
        r.finish_reason = FinishReason.STOP
        pred.observe(r)
    assert pred.predict(request("n", prompt(30), max_tokens=100, tenant="a")) == 25
    assert pred.predict(request("m", prompt(30), max_tokens=40, tenant="a")) == 10
    assert pred.error.count == 4 and pred.error.mean_abs_tokens == pytest.approx(75 / 2)


def test_measured_step_costs_replace_the_defaults():
    from scheduler_svc.core.remaining_work import StepFit

    policy = GoodputPolicy()
    policy.measured(StepFit(base_s=0.03, per_token_s=1e-3), batch=4, num_workers=3)
    assert policy.costs.prefill_s_per_token == pytest.approx(1e-3)
    assert policy.costs.decode_s_per_token == pytest.approx(0.031)
    assert policy.costs.decode_work_s_per_token == pytest.approx((0.03 + 4e-3) / 4)
    assert policy.decode_s_per_seq == pytest.approx(1e-3)
    assert policy.num_workers == 3
    before = policy.costs
    policy.measured(StepFit(base_s=0.0, per_token_s=0.0), batch=4, num_workers=1)
    assert policy.costs == before  # nothing measured says nothing


def test_slower_measured_steps_make_a_request_hopeless():
    from scheduler_svc.core.remaining_work import StepFit

    policy = GoodputPolicy()
    policy.clock = lambda: 0.0
    r = request("r", prompt(10), max_tokens=10)
    r.deadline = 1.0
    policy.key(r)
    policy.measured(StepFit(base_s=0.05, per_token_s=0.0), batch=1, num_workers=1)
    assert "r" in policy.replan(0.0).feasible  # 10 steps of 50 ms
    policy.measured(StepFit(base_s=0.2, per_token_s=0.0), batch=1, num_workers=1)
    assert "r" in policy.replan(0.0).hopeless  # 10 steps of 200 ms


def test_a_ttft_target_orders_like_a_deadline_for_the_first_token():
    policy = GoodputPolicy(prefill_s_per_token=0.0, decode_s_per_token=0.01)
    policy.clock = lambda: 0.0
    late = request("late", prompt(4), max_tokens=10)
    late.deadline = 5.0
    soon = request("soon", prompt(4), max_tokens=10)
    soon.ttft_deadline = 0.5  # first token by 0.5 s, then 9 steps: due at 0.59 s
    assert policy.due(soon) == pytest.approx(0.59)
    assert policy.key(soon) < policy.key(late)
    hopeless = request("hopeless", prompt(4), max_tokens=10)
    hopeless.ttft_deadline = 0.005  # its first token takes one step of 10 ms
    policy.key(hopeless)
    assert "hopeless" in policy.replan(0.0).hopeless
    soon.output_token_ids.append(7)  # the first token is out: the TTFT target is settled
    assert policy.due(soon) is None


def test_a_tpot_target_bounds_the_batch_it_shares():
    policy = GoodputPolicy(prefill_s_per_token=0.0, decode_s_per_token=0.02, decode_s_per_seq=0.01)
    policy.clock = lambda: 0.0
    running = request("running", prompt(4), max_tokens=50)
    running.tpot_target_s = 0.025  # one step alone 20 ms; two in the batch: 30 ms
    policy.account([running], [4])
    running.status = RequestStatus.RUNNING
    newcomer = request("new", prompt(4), max_tokens=5)
    newcomer.deadline = 10.0
    policy.key(newcomer)
    policy.refresh(0.0)
    assert policy.plan.standing("new") == 1  # feasible: held back by its first token alone
    assert not policy.admits(newcomer)
    running.tpot_target_s = 0.035
    assert policy.admits(newcomer)
    newcomer.tpot_target_s = 0.015  # slower than a step alone: hopeless
    policy.refresh(0.0)
    assert "new" in policy.plan.hopeless


def test_targets_met_checks_the_deadline_the_first_token_and_the_mean_gap():
    from scheduler_svc.core.remaining_work import targets_met

    ok = {"arrival": 0.0, "first_token": 0.2, "finish": 1.2, "num_outputs": 11}
    assert targets_met(**ok, deadline=1.5, ttft_target_s=0.3, tpot_target_s=0.1)
    assert not targets_met(**ok, deadline=1.0)
    assert not targets_met(**ok, ttft_target_s=0.1)
    assert not targets_met(**ok, tpot_target_s=0.09)
    assert not targets_met(**{**ok, "first_token": None}, ttft_target_s=5.0)


def test_deadline_policy_counts_the_predicted_work_in_the_eight_request_case():
    # with only one more token assumed it ran all eight and met 1 (2 with min_tokens =
    # max_tokens); the predicted remaining work demotes the ones that cannot finish
    trace = eight_requests()
    assert met("deadline", trace) == best_order(trace)


def test_goodput_scenario_has_a_trace_with_ttft_and_tpot_targets():
    from splitserve.sim.scenarios import build_runs

    runs = build_runs("goodput", COST, num_requests=20, request_rate=5.0, policies=("goodput",))
    targets = [(s, t) for s, t in runs if s.label.endswith(" targets")]
    assert len(targets) == 4  # one per load
    settings, trace = targets[0]
    with_targets = [r for r in trace if r.ttft_target_s is not None]
    assert with_targets and all(r.deadline is None and r.tpot_target_s for r in with_targets)
    assert any(r.deadline is not None for r in trace)  # the others keep their deadlines
    res = simulate(settings, trace, COST)
    assert not res.stuck
    met = [r.met_deadline for r in res.records if r.ttft_target_s is not None]
    assert None not in met and any(met)  # judged by targets_met, and some are met


def test_a_ttft_target_admits_on_its_first_token_not_on_the_folded_deadline():
    # the fold (first token by the target, then a step alone per token) is missed by any
    # batch's slower steps; only the first token is the TTFT target's business
    policy = GoodputPolicy(prefill_s_per_token=0.0, decode_s_per_token=0.01, decode_s_per_seq=0.01)
    policy.clock = lambda: 0.0
    running = request("running", prompt(4), max_tokens=50, deadline=100.0)
    policy.account([running], [4])
    running.status = RequestStatus.RUNNING
    newcomer = request("new", prompt(4), max_tokens=50)
    newcomer.ttft_deadline = 0.5  # folded: due at 0.99; 50 steps of 20 ms end at 1.0
    policy.key(newcomer)
    policy.refresh(0.0)
    assert policy.plan.feasible == {"running", "new"}
    assert policy.admits(newcomer)
    newcomer.ttft_deadline = 0.015  # its first step alone takes 20 ms in this batch
    policy.refresh(0.0)
    assert policy.plan.standing("new") == 1
    assert policy.admits(newcomer)  # no deadline lost: admitted as EDF would
    late = request("late", prompt(4), max_tokens=50, deadline=0.1)  # hopeless: 0.5 s alone
    policy.key(late)
    policy.refresh(0.0)
    assert policy.plan.standing("new") == 1  # feasible: held back by its first token alone
    assert not policy.admits(newcomer)


def met_on_a_fake_clock(policy: str, trace: list[TraceRequest], step_s: float, **options) -> int:
    """The core alone, one request at a time, on a worker whose every step takes ``step_s`` and
    samples one token per scheduled request."""
    clock = [0.0]
    sched = Scheduler(
        SchedulerConfig(policy=policy, policy_options=options, max_num_seqs=1, num_blocks=512)
    )
    sched.policy.clock = lambda: clock[0]  # type: ignore[method-assign]
    for tr in trace:
        sched.add_request(
            request(
                tr.request_id,
                prompt(tr.prompt_len),
                max_tokens=tr.output_len,
                deadline=tr.deadline,
                ignore_eos=True,
            )
        )
    on_time = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        clock[0] += step_s
        sampled = {rid: [7] for rid in out.num_scheduled_tokens}
        for o in sched.update_from_output(out, sampled):
            deadline = next(tr.deadline for tr in trace if tr.request_id == o.request_id)
            on_time += o.finished and deadline is not None and clock[0] <= deadline + 1e-9
    return on_time


# (step time, output tokens): a worker twice as fast as the default costs assume, and one as
# fast with requests half as long; in both the best serial order meets three deadlines
FAKE_WORKERS = [(0.01, 18), (0.02, 10)]


DEFAULT_COSTS = {"prefill_s_per_token": 2e-4, "decode_s_per_token": 0.02}


def eight_requests_of(output_len: int) -> list[TraceRequest]:
    return [
        TraceRequest(tr.request_id, 0.0, tr.prompt_len, output_len, deadline=tr.deadline)
        for tr in eight_requests()
    ]


@pytest.mark.parametrize(("step_s", "output_len"), FAKE_WORKERS)
def test_without_costs_goodput_learns_the_step_time_from_its_clock(step_s, output_len):
    trace = eight_requests_of(output_len)
    best = best_order(trace, lambda tr: tr.output_len * step_s)  # one token a step
    assert best == 3
    assert met_on_a_fake_clock("goodput", trace, step_s) >= best


@pytest.mark.parametrize(("step_s", "output_len", "before"), [(0.01, 18, 1), (0.02, 10, 2)])
def test_given_costs_goodput_does_not_learn(step_s, output_len, before):
    trace = eight_requests_of(output_len)
    assert met_on_a_fake_clock("goodput", trace, step_s, **DEFAULT_COSTS) == before


def test_without_costs_the_deadline_policy_learns_the_step_time_too():
    trace = eight_requests()
    assert met_on_a_fake_clock("deadline", trace, 0.01, **DEFAULT_COSTS) == 2
    assert met_on_a_fake_clock("deadline", trace, 0.01) == 3


def test_before_any_step_and_after_a_measured_fit_the_costs_are_not_learned():
    policy = GoodputPolicy()
    assert policy.costs == GoodputPolicy(prefill_s_per_token=2e-4, decode_s_per_token=0.02).costs
    now = [0.0]
    policy.clock = lambda: now[0]
    r = request("r", prompt(10), max_tokens=10)
    policy.account([r], [10])  # one step: no time between steps yet
    assert policy.costs.decode_s_per_token == 0.02
    now[0] = 0.05
    policy.account([r], [1])
    assert policy.costs.decode_s_per_token == pytest.approx(0.05)
    policy.measured(StepFit(base_s=0.03, per_token_s=0.0), batch=1, num_workers=1)
    now[0] = 0.06
    policy.account([r], [1])
    assert policy.costs.decode_s_per_token == pytest.approx(0.03)  # the service's fit wins


def test_step_clock_fits_base_and_price_per_token_and_skips_idle_gaps():
    steps = StepClock()
    r = request("r", prompt(100), max_tokens=50)
    t = 0.0
    for tokens in [100, *[1] * 20]:
        steps.step(t, [r], [tokens])
        t += 0.01 + 1e-4 * tokens
    fit = steps.fit()
    assert fit is not None
    assert fit.base_s == pytest.approx(0.01) and fit.per_token_s == pytest.approx(1e-4)
    steps.step(t + 5.0, [r], [1])  # the worker sat idle
    assert steps.predict_s(1) == pytest.approx(0.0101)
    t += 5.0
    for _ in range(steps.patience):  # the steps themselves got slower: start over from them
        t += 0.5
        steps.step(t, [r], [1])
    assert steps.predict_s(1) == pytest.approx(0.5)


def test_step_clock_pairs_steps_of_one_request_not_of_two_workers():
    steps = StepClock()
    a, b = request("a", prompt(4)), request("b", prompt(4))
    for k in range(10):  # two workers sharing the policy step in turn, 20 ms apart each
        steps.step(0.02 * k, [a], [1])
        steps.step(0.02 * k + 0.001, [b], [1])
    assert steps.predict_s(1) == pytest.approx(0.02)
    a.status = RequestStatus.FINISHED
    steps.step(0.2, [b], [1])
    assert "a" not in steps._last
