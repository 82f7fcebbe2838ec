"""--worker-wait-timeout on every way a request reaches the global queue: submitted, resumed by
a front-end, placed after a takeover, a parked n > 1 sibling let go, handed back by a worker that
died or drains. While no worker takes requests each one fails after the timeout with a
sentence; a worker that attaches first gets every one of them, and then none fails for waiting
behind the others (issue #35, problem 7)."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_svc.core import FinishReason
from tests.engine_fakes import (
    FakeWorker,
    drain,
    make_engine,
    make_state,
    reference,
    registration,
    run_session,
)

PROMPT = [11, 12, 13, 14, 15]
MAX_TOKENS = 6


async def submitted(engine, state) -> None:
    engine.submit(state)


async def resumed(engine, state) -> None:
    engine.resume_client([state])


async def placed_after_a_takeover(engine, state) -> None:
    engine.begin_rebuild()
    engine.resume_client([state])
    engine.finish_rebuild()


async def submitted_during_a_takeover(engine, state) -> None:
    engine.begin_rebuild()
    engine.submit(state)
    engine.finish_rebuild()


async def parked_sibling(engine, state) -> None:
    first = make_state("first", PROMPT, MAX_TOKENS)
    state.prefill_after = "first"
    engine.submit(first)
    engine.submit(state)


async def handed_back_by_a_dead_worker(engine, state) -> None:
    dying = engine.attach(registration("dying"), FakeWorker(fail_at_step=3))
    engine.submit(state)
    await run_session(engine, dying)
    assert engine.record(state).worker_id is None and engine.record(state).num_migrations == 1


async def handed_back_by_the_only_worker_draining(engine, state) -> None:
    leaving = engine.attach(registration("leaving"), FakeWorker())  # no step loop: it only queues
    engine.submit(state)
    assert engine.record(state).worker_id == "leaving"
    engine.start_drain(leaving, 30.0)


async def submitted_while_the_only_worker_drains(engine, state) -> None:
    leaving = engine.attach(registration("leaving"), FakeWorker())
    engine.start_drain(leaving, 30.0)
    engine.submit(state)


async def queued_behind_a_worker_that_died(engine, state) -> None:
    """The worker was full, so the request waited in the global queue when the worker died."""
    full = engine.attach(registration("full"), FakeWorker())  # no step loop: nothing runs
    limit = engine.config.max_num_seqs + engine.config.worker_queue_depth
    for i in range(limit):
        engine.submit(make_state(f"ahead-{i}", [1, 2, 3, i], MAX_TOKENS))
    engine.submit(state)
    assert engine.record(state).worker_id is None
    full.mark_lost("test: died")
    engine.detach(full, "test: died")


PATHS = [
    submitted,
    resumed,
    placed_after_a_takeover,
    submitted_during_a_takeover,
    parked_sibling,
    handed_back_by_a_dead_worker,
    handed_back_by_the_only_worker_draining,
    submitted_while_the_only_worker_drains,
    queued_behind_a_worker_that_died,
]


@pytest.mark.parametrize("enter", PATHS, ids=lambda f: f.__name__)
def test_a_request_no_worker_takes_fails_after_the_wait_timeout(enter):
    async def main():
        engine = make_engine(worker_wait_timeout=0.1)
        state = make_state("r", PROMPT, MAX_TOKENS)
        await enter(engine, state)
        _, deltas = await drain(state)
        assert deltas[-1].finish_reason == FinishReason.ERROR
        assert deltas[-1].error_code == "UNAVAILABLE" and "no worker" in deltas[-1].error
        assert "r" not in engine.requests and "r" not in engine.waiting

    asyncio.run(main())


@pytest.mark.parametrize("enter", PATHS, ids=lambda f: f.__name__)
def test_a_request_waiting_when_a_worker_attaches_runs_there(enter):
    async def main():
        engine = make_engine(worker_wait_timeout=5.0)
        state = make_state("r", PROMPT, MAX_TOKENS)
        await enter(engine, state)
        assert engine.record(state).worker_id is None
        session = engine.attach(registration("late"), FakeWorker())
        task = asyncio.create_task(run_session(engine, session))
        tokens, deltas = await drain(state)
        assert tokens == reference(PROMPT, MAX_TOKENS)
        assert deltas[-1].finish_reason == FinishReason.LENGTH and deltas[-1].worker_id == "late"
        assert engine.record(state).wait_timer is None
        session.mark_lost("test over")
        await task

    asyncio.run(main())


class SlowWorker(FakeWorker):
    """Steps that take a while: requests queue behind each other far past the wait timeout."""

    async def execute(self, out):
        await asyncio.sleep(0.01)
        return await FakeWorker.execute(self, out)


def test_requests_queued_behind_others_on_a_worker_do_not_time_out():
    async def main():
        engine = make_engine(worker_wait_timeout=0.05, max_num_seqs=2, worker_queue_depth=1)
        states = [make_state(f"r{i}", [20 + i, 21, 22], 10) for i in range(8)]
        for state in states:
            engine.submit(state)
        session = engine.attach(registration("w"), SlowWorker())
        task = asyncio.create_task(run_session(engine, session))
        results = await asyncio.gather(*(drain(s) for s in states))
        for state, (tokens, deltas) in zip(states, results, strict=True):
            assert deltas[-1].finish_reason == FinishReason.LENGTH, deltas[-1].error
            assert tokens == reference(state.prompt_token_ids, 10)
        session.mark_lost("test over")
        await task

    asyncio.run(main())


def test_after_the_last_worker_leaves_queued_requests_wait_again_then_fail():
    async def main():
        engine = make_engine(worker_wait_timeout=0.1, max_num_seqs=1, worker_queue_depth=1)
        session = engine.attach(registration("w"), SlowWorker())
        task = asyncio.create_task(run_session(engine, session))
        states = [make_state(f"r{i}", [30 + i, 31], 200) for i in range(4)]
        for state in states:
            engine.submit(state)
        first = await asyncio.wait_for(states[0].queue.get(), 10)
        assert first.token_ids  # it runs; the others wait behind it
        session.mark_lost("test: the worker died")
        await task
        for state in states:
            _, deltas = await drain(state)
            assert deltas[-1].error_code == "UNAVAILABLE" and "no worker" in deltas[-1].error
        assert not engine.requests and not engine.waiting

    asyncio.run(main())


def test_a_worker_that_comes_and_goes_during_a_takeover_leaves_the_request_waiting():
    """Nothing is dispatched while a new leader rebuilds; a worker that attaches then and is
    lost before the rebuild ends leaves the timeout running again."""

    async def main():
        engine = make_engine(worker_wait_timeout=0.1)
        engine.begin_rebuild()
        state = make_state("r", PROMPT, MAX_TOKENS)
        engine.submit(state)
        brief = engine.attach(registration("brief"), FakeWorker())
        assert engine.record(state).worker_id is None and engine.record(state).wait_timer is None
        brief.mark_lost("test: gone during the rebuild")
        engine.detach(brief, "test: gone during the rebuild")
        engine.finish_rebuild()
        _, deltas = await drain(state)
        assert deltas[-1].error_code == "UNAVAILABLE" and "no worker" in deltas[-1].error

    asyncio.run(main())
