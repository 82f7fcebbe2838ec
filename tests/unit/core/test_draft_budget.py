"""How many drafts a step takes (draft_budget.py), and the scheduler keeping to it: all of them
while the worker's measured step is flat, none once it is arithmetic, the acceptance and the
worker's wait weighing in; without measurements the fixed batch limit."""

from __future__ import annotations

import pytest

from scheduler_svc.core import Scheduler
from scheduler_svc.core.draft_budget import DraftBudget
from scheduler_svc.core.preemption_cost import WorkerCosts
from scheduler_svc.core.speculative import UNMEASURED_MAX_BATCH, SpeculativeConfig
from tests.factories import request, scheduler_factory

# a CPU-like curve: reading the weights up to 8 tokens, then arithmetic (seconds of 1, 2, ... 64)
KNEE = [0.014, 0.0142, 0.0145, 0.015, 0.019, 0.027, 0.051]


def test_step_time_interpolates_and_extrapolates():
    budget = DraftBudget(KNEE)
    assert budget.step_time(1) == 0.014 and budget.step_time(16) == 0.019
    assert budget.step_time(24) == pytest.approx((0.019 + 0.027) / 2)
    assert budget.step_time(128) == pytest.approx(0.051 + (0.051 - 0.027) * 2)  # last segment
    assert DraftBudget([0.01]).step_time(4) == pytest.approx(0.04)
    with pytest.raises(ValueError):
        DraftBudget([])


def test_drafts_while_the_step_is_flat_and_none_once_it_is_arithmetic():
    budget = DraftBudget(KNEE)
    assert budget.best(rows=1, most=6) == 6
    assert budget.best(rows=4, most=24) == 24
    assert budget.best(rows=64, most=384) == 0
    linear = DraftBudget([0.001 * 2**i for i in range(7)])  # every token costs its share
    assert linear.best(rows=1, most=6) == 0


def test_low_acceptance_and_a_long_wait_turn_drafting_down():
    budget = DraftBudget(KNEE)
    assert 0 < budget.best(rows=8, most=48) < 48
    assert budget.best(rows=16, most=96) == 0  # promises less than MIN_GAIN
    for _ in range(100):
        budget.verified(drafted=6, accepted=0)
    assert budget.acceptance < 0.01
    assert budget.best(rows=8, most=48) == 0
    assert budget.best(rows=1, most=6) == 0  # a drafted token that is never kept only costs
    eager = DraftBudget(KNEE)
    eager.waited(0.1)  # waiting for the drafting requests costs more than the drafts bring
    assert eager.best(rows=1, most=6) == 0


make = scheduler_factory(
    block_size=4, num_blocks=1024, max_model_len=256, max_num_seqs=128, max_num_batched_tokens=4096
)


def _sched(max_batch=None, costs=None) -> Scheduler:
    spec = SpeculativeConfig(num_speculative_tokens=4, max_batch=max_batch)
    return make(speculative=spec, worker_costs=costs)


def _drafts_at(sched: Scheduler, rows: int) -> int:
    """Drafted tokens in the first decode step of `rows` requests that all repeat themselves."""
    for i in range(rows):
        sched.add_request(request(f"r{i}", [5, 6, 7, 8] * 4, max_tokens=64, ignore_eos=True))
    out = sched.schedule()  # the prefills
    sched.update_from_output(out, {rid: [5] for rid in out.num_scheduled_tokens})
    out = sched.schedule()
    assert len(out.num_scheduled_tokens) == rows
    return sum(map(len, out.spec_token_ids.values()))


@pytest.mark.parametrize(
    ("rows", "costs", "max_batch", "drafted"),
    [
        (1, WorkerCosts(verify_step_s=tuple(KNEE)), None, 4),
        (64, WorkerCosts(verify_step_s=tuple(KNEE)), None, 0),
        (4, WorkerCosts(verify_step_s=tuple(KNEE)), 2, 0),  # a set max_batch still caps
        (UNMEASURED_MAX_BATCH, None, None, 4 * UNMEASURED_MAX_BATCH),
        (UNMEASURED_MAX_BATCH + 1, None, None, 0),
    ],
)
def test_the_scheduler_drafts_what_the_budget_allows(rows, costs, max_batch, drafted):
    assert _drafts_at(_sched(max_batch, costs), rows) == drafted


def test_a_partial_budget_goes_to_the_first_requests():
    costs = WorkerCosts(verify_step_s=tuple(KNEE))
    sched = _sched(costs=costs)
    budget = DraftBudget(KNEE).best(8, 8 * 4)
    assert 0 < budget < 32
    assert _drafts_at(sched, 8) == budget
