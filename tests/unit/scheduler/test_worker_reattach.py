"""A worker that comes back under its old id (restarted by `splitserve up`) takes its place."""

from __future__ import annotations

import asyncio

from scheduler_svc.core import FinishReason
from scheduler_svc.obs.engine_observer import EngineObserver
from tests.engine_fakes import (
    FakeWorker,
    drain,
    make_engine,
    make_state,
    reference,
    registration,
)


class WorkerEvents(EngineObserver):
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def on_worker_attached(self, session) -> None:
        self.events.append(("attached", id(session)))

    def on_worker_detached(self, session, reason: str) -> None:
        self.events.append(("detached", id(session)))


def test_a_worker_restarted_under_its_id_serves_after_its_old_link_ends():
    async def main():
        engine = make_engine()
        engine.observer = events = WorkerEvents()
        old = engine.attach(registration("worker-1"), FakeWorker())
        new = engine.attach(registration("worker-1"), FakeWorker())
        assert old.lost and not new.lost
        # the old link's stream ends only now: the new session must not be detached with it
        engine.detach(old, "stream error")
        assert events.events == [
            ("attached", id(old)),
            ("detached", id(old)),
            ("attached", id(new)),
        ]
        assert engine.sessions == {"worker-1": new}
        assert engine.worker_attached.is_set()
        task = asyncio.create_task(engine.run_worker(new))
        states = [make_state(f"r{i}", [4, 5, i], 6) for i in range(3)]
        for state in states:
            engine.submit(state)
        for state in states:
            tokens, deltas = await drain(state)
            assert tokens == reference(state.prompt_token_ids, 6)
            assert deltas[-1].finish_reason == FinishReason.LENGTH
            assert engine.record(state).worker_id is None  # finished
        task.cancel()

    asyncio.run(main())


def test_a_lost_worker_registers_again_under_its_id():
    async def main():
        engine = make_engine()
        first = engine.attach(registration("worker-0"), FakeWorker())
        task = asyncio.create_task(engine.run_worker(first))
        state = make_state("r0", [9, 8, 7], 50)
        engine.submit(state)
        while len(state.output_token_ids) < 3:
            await asyncio.sleep(0)
        first.mark_lost("stream error: connection reset")  # killed with -9
        await task
        engine.detach(first, first.lost_reason)
        assert engine.sessions == {}
        again = engine.attach(registration("worker-0"), FakeWorker())
        task = asyncio.create_task(engine.run_worker(again))
        tokens, _ = await drain(state)
        assert tokens == reference([9, 8, 7], 50)
        assert engine.record(state).num_migrations == 1
        task.cancel()

    asyncio.run(main())
