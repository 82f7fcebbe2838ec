"""n > 1 in the engine: a sibling waits ("parked") until the first request of its group has its
prompt computed, then finds it in the prefix cache; it is never stranded by the first one's
end, and dropping it while parked leaves nothing behind."""

from __future__ import annotations

import asyncio

from tests.engine_fakes import (
    FakeWorker,
    drain,
    make_engine,
    make_state,
    reference,
    registration,
    run_session,
)

PROMPT = list(range(200, 216))  # 4 blocks of 4


def group(size: int, max_tokens: int = 5):
    states = [make_state("g" if i == 0 else f"g-{i}", PROMPT, max_tokens) for i in range(size)]
    for s in states[1:]:
        s.prefill_after = "g"
    return states


def test_siblings_wait_for_the_first_prompt_then_hit_the_cache():
    async def main():
        engine = make_engine()
        session = engine.attach(registration("w0"), FakeWorker())
        task = asyncio.create_task(run_session(engine, session))
        states = group(3)
        for s in states:
            engine.submit(s)
        assert len(engine._parked["g"]) == 2 and len(engine.waiting) + session.load == 1
        results = await asyncio.gather(*(drain(s) for s in states))
        assert [tokens for tokens, _ in results] == [reference(PROMPT, 5)] * 3
        stats = session.scheduler.stats()
        assert stats.prefix_cache_hits == 2 * 12  # 3 of 4 blocks each
        assert not engine._parked and stats.num_free_blocks == 64
        session.mark_lost("test over")
        await task

    asyncio.run(main())


def test_siblings_run_when_the_first_is_aborted_before_its_prompt_is_done():
    async def main():
        engine = make_engine()
        states = group(3)
        for s in states:
            engine.submit(s)  # no worker yet: the first waits in the queue
        assert engine.abort("g")
        assert not engine._parked and len(engine.waiting) == 2
        engine.drop("g-2")  # a client that leaves: nothing of it is left
        assert len(engine.waiting) == 1 and set(engine.requests) == {"g-1"}
        session = engine.attach(registration("w0"), FakeWorker())
        task = asyncio.create_task(run_session(engine, session))
        tokens, _ = await drain(states[1])
        assert tokens == reference(PROMPT, 5)
        session.mark_lost("test over")
        await task

    asyncio.run(main())


def test_a_parked_sibling_dropped_by_its_client_is_forgotten():
    async def main():
        engine = make_engine()
        states = group(2)
        for s in states:
            engine.submit(s)
        engine.drop("g-1")
        assert engine._parked == {"g": []} and set(engine.requests) == {"g"}
        engine.abort("g")
        assert not engine._parked and not engine.requests and not engine.waiting

    asyncio.run(main())


def test_preempting_group_members_leaks_no_shared_block():
    async def main():
        engine = make_engine()
        # 3 choices of 16 prompt + 24 output tokens need 10 blocks each (3 of them shared):
        # 16 blocks force preemptions
        session = engine.attach(registration("w0", num_blocks=16), FakeWorker())
        task = asyncio.create_task(run_session(engine, session))
        states = group(3, max_tokens=24)
        for s in states:
            engine.submit(s)
        results = await asyncio.gather(*(drain(s) for s in states))
        assert [tokens for tokens, _ in results] == [reference(PROMPT, 24)] * 3
        stats = session.scheduler.stats()
        assert stats.num_preemptions > 0
        assert stats.num_free_blocks == 16 and stats.num_used_blocks == 0
        session.mark_lost("test over")
        await task

    asyncio.run(main())
