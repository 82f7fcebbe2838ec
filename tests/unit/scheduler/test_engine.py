"""The serving engine with fake workers (no gRPC, no model): placement, streaming, migration."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_svc.core import FinishReason, SamplingParams
from tests.engine_fakes import (
    FakeDecoder,
    FakeWorker,
    drain,
    make_engine,
    make_state,
    reference,
    registration,
    run_session,
    submit_and_drain,
)


def test_requests_finish_with_reference_tokens():
    async def main():
        engine = make_engine()
        sessions = [engine.attach(registration(f"w{i}"), FakeWorker()) for i in range(2)]
        tasks = [asyncio.create_task(engine.run_worker(s)) for s in sessions]
        states = [
            make_state(f"r{i}", [1 + i, 2, 3, 4, 5 + i] * (1 + i % 3), 5 + i) for i in range(10)
        ]
        for s in states:
            engine.submit(s)
        # placement spreads the load
        assert {engine.record(s).worker_id for s in states} == {"w0", "w1"}
        results = await asyncio.gather(*(drain(s) for s in states))
        for state, (tokens, deltas) in zip(states, results, strict=True):
            assert tokens == reference(state.prompt_token_ids, state.params.max_tokens)
            assert deltas[-1].finish_reason == FinishReason.LENGTH
            assert "".join(d.text for d in deltas) == FakeDecoder().decode(tokens)
        for t in tasks:
            t.cancel()
        assert not engine.requests
        for s in sessions:
            stats = s.scheduler.stats()
            assert stats.num_free_blocks == stats.num_total_blocks

    asyncio.run(main())


def test_lost_worker_requests_continue_elsewhere_without_gap_or_duplicate():
    async def main():
        engine = make_engine()
        dying = engine.attach(registration("dying"), FakeWorker(fail_at_step=4))
        t1 = asyncio.create_task(run_session(engine, dying))
        states = [make_state(f"r{i}", [7, 8, 9, i], 12) for i in range(4)]
        for s in states:
            engine.submit(s)
        await asyncio.sleep(0.05)  # the worker dies after a few steps
        await t1
        assert all(engine.record(s).worker_id is None for s in states), (
            "requests should wait for a new worker"
        )
        healthy = engine.attach(registration("healthy"), FakeWorker())
        t2 = asyncio.create_task(engine.run_worker(healthy))
        results = await asyncio.gather(*(drain(s) for s in states))
        for state, (tokens, _) in zip(states, results, strict=True):
            assert tokens == reference(state.prompt_token_ids, 12)
            assert engine.record(state).num_migrations == 1
        t2.cancel()

    asyncio.run(main())


@pytest.mark.parametrize("interval", [1, 3])
def test_stream_interval_groups_tokens_through_a_migration(interval):
    """--stream-interval: the first token at once, then `interval` tokens per message, the
    last message whatever is left; across a lost worker no token is missing or repeated."""

    async def main():
        engine = make_engine(stream_interval=interval)
        dying = engine.attach(registration("dying"), FakeWorker(fail_at_step=5))
        healthy = engine.attach(registration("healthy"), FakeWorker())
        tasks = [
            asyncio.create_task(run_session(engine, dying)),
            asyncio.create_task(engine.run_worker(healthy)),
        ]
        states = [make_state(f"r{i}", [7, 8, 9, i], 11) for i in range(4)]
        results = await submit_and_drain(engine, states)
        for state, (tokens, deltas) in zip(states, results, strict=True):
            assert tokens == reference(state.prompt_token_ids, 11)
            assert "".join(d.text for d in deltas) == FakeDecoder().decode(tokens)
            sizes = [len(d.token_ids) for d in deltas]
            assert sizes[0] == 1 and all(n == interval for n in sizes[1:-1])
            assert 1 <= sizes[-1] <= interval
            assert [d.num_output_tokens for d in deltas][-1] == 11
        assert sum(engine.record(s).num_migrations for s in states) >= 1
        # a request that asked for logprobs streams each token with its logprobs
        wants_logprobs = make_state("lp", [1, 2, 3], 4)
        wants_logprobs.params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1)
        engine.submit(wants_logprobs)
        assert wants_logprobs.stream_interval == 1
        tokens, deltas = await drain(wants_logprobs)
        assert [len(d.token_ids) for d in deltas] == [1, 1, 1, 1]
        tasks[1].cancel()
        with pytest.raises(ValueError, match="adaptive"):
            make_engine(stream_interval=-1)

    asyncio.run(main())


def test_adaptive_stream_interval_batches_while_workers_wait():
    """--stream-interval 0: a worker that reports waiting on the scheduler makes streams carry
    more tokens per message; the tokens are the same."""

    class WaitingWorker(FakeWorker):
        async def execute(self, out):
            reply = await super().execute(out)
            reply.idle_time_s = 0.01  # 10 ms a step waiting on the scheduler
            return reply

    async def main():
        engine = make_engine(stream_interval=0)
        assert engine.pacer.adaptive and engine.pacer.interval == 1
        engine.pacer.window_s = 0.0  # every step a window of its own, for the test
        session = engine.attach(registration("w"), WaitingWorker())
        task = asyncio.create_task(engine.run_worker(session))
        states = [make_state(f"r{i}", [4, 5, 6, i], 40) for i in range(4)]
        results = await submit_and_drain(engine, states)
        for state, (tokens, deltas) in zip(states, results, strict=True):
            assert tokens == reference(state.prompt_token_ids, 40)
            assert len(deltas[0].token_ids) == 1 and max(len(d.token_ids) for d in deltas) > 1
        assert engine.pacer.interval > 1
        task.cancel()

    asyncio.run(main())


class GatedWorker(FakeWorker):
    """A FakeWorker whose steps wait for the test to open a gate; records what each step
    admitted (new requests) and when it was submitted relative to the others."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()
        self.admitted: list[list[str]] = []

    async def submit(self, out):
        self.admitted.append([r.request_id for r in out.new_requests])
        return await super().submit(out)

    async def execute(self, out):
        await self.gate.wait()
        return await super().execute(out)


def test_a_step_after_a_pause_runs_alone_so_a_burst_joins_the_next():
    """Async scheduling pipelines step N+1 behind step N, but not behind a step sent after the
    worker had nothing to do: requests still arriving then (a burst reaches the scheduler over
    tens of ms) go into the next step together instead of a pipelined step of one."""

    async def main():
        engine = make_engine()
        worker = GatedWorker()
        session = engine.attach(registration("w"), worker)
        task = asyncio.create_task(engine.run_worker(session))
        worker.gate.clear()
        first = make_state("r0", [1, 2, 3, 4], 3)
        engine.submit(first)
        for _ in range(5):
            await asyncio.sleep(0)
        assert worker.admitted == [["r0"]]  # step 1 sent, no step pipelined behind it
        rest = [make_state(f"r{i}", [i, 2, 3, 4], 3) for i in range(1, 4)]
        for s in rest:
            engine.submit(s)
        worker.gate.set()
        results = await asyncio.gather(*(drain(s) for s in [first, *rest]))
        assert worker.admitted[1] == ["r1", "r2", "r3"]
        for state, (tokens, _) in zip([first, *rest], results, strict=True):
            assert tokens == reference(state.prompt_token_ids, 3)
        task.cancel()

    asyncio.run(main())


def test_the_waits_a_pause_causes_do_not_raise_the_stream_interval():
    """Requests one at a time: each one's first step follows a pause, its second one waits on
    the first's result (a step after a pause is not pipelined). The worker waits before both,
    and neither wait is the scheduler falling behind: the interval stays at one token."""

    class WaitingWorker(FakeWorker):
        async def execute(self, out):
            reply = await super().execute(out)
            reply.idle_time_s = 0.01
            return reply

    async def main():
        engine = make_engine(stream_interval=0)
        engine.pacer.window_s = 0.0
        session = engine.attach(registration("w"), WaitingWorker())
        task = asyncio.create_task(engine.run_worker(session))
        for i in range(12):
            ((tokens, _),) = await submit_and_drain(engine, [make_state(f"r{i}", [4, 5, i], 2)])
            assert tokens == reference([4, 5, i], 2)
        assert engine.pacer.interval == 1
        task.cancel()

    asyncio.run(main())


def test_a_pipelined_step_draws_on_a_refilled_worker_queue():
    """The worker's queue holds --worker-queue-depth requests; the queue is refilled from the
    global one before every step, also the one scheduled while the previous step runs."""

    async def main():
        engine = make_engine(worker_queue_depth=2)
        worker = GatedWorker()
        session = engine.attach(registration("w"), worker)
        states = [make_state(f"r{i}", [i, 2, 3, 4], 30) for i in range(8)]
        for s in states:
            engine.submit(s)
        task = asyncio.create_task(engine.run_worker(session))
        results = await asyncio.gather(*(drain(s) for s in states))
        # two per step (the queue's depth), also in the steps pipelined behind another
        assert [len(a) for a in worker.admitted[:4]] == [2, 2, 2, 2]
        for state, (tokens, _) in zip(states, results, strict=True):
            assert tokens == reference(state.prompt_token_ids, 30)
        task.cancel()

    asyncio.run(main())


def test_too_many_migrations_fail_with_a_sentence():
    async def main():
        engine = make_engine(max_migrations=0)
        dying = engine.attach(registration("dying"), FakeWorker(fail_at_step=2))
        state = make_state("r", [1, 2, 3], 10)
        engine.submit(state)
        await run_session(engine, dying)
        tokens, deltas = await drain(state)
        assert deltas[-1].finish_reason == FinishReason.ERROR
        assert "lost its worker" in deltas[-1].error and deltas[-1].error_code == "UNAVAILABLE"

    asyncio.run(main())


def test_waiting_for_a_worker_then_unavailable():
    async def main():
        engine = make_engine()
        state = make_state("r", [1, 2, 3], 4)
        engine.submit(state)
        _, deltas = await drain(state)
        assert deltas[-1].error_code == "UNAVAILABLE" and "no worker" in deltas[-1].error
        assert not engine.requests

        # a worker attaching in time picks the request up
        late = make_state("late", [1, 2, 3], 4)
        engine.submit(late)
        session = engine.attach(registration("w"), FakeWorker())
        task = asyncio.create_task(engine.run_worker(session))
        tokens, _ = await drain(late)
        assert tokens == reference([1, 2, 3], 4)
        task.cancel()

    asyncio.run(main())


def test_stop_string_ends_request_and_frees_blocks():
    async def main():
        engine = make_engine()
        session = engine.attach(registration("w"), FakeWorker())
        task = asyncio.create_task(engine.run_worker(session))
        prompt = [5, 6, 7]
        ref = reference(prompt, 20)
        stop = f"<{ref[3]}>"
        state = make_state("r", prompt, 20, stop=[stop])
        engine.submit(state)
        tokens, deltas = await drain(state)
        text = "".join(d.text for d in deltas)
        assert deltas[-1].finish_reason == FinishReason.STOP and deltas[-1].stop_reason == stop
        assert text == FakeDecoder().decode(ref[:3])
        await asyncio.sleep(0.01)
        assert not session.request_ids
        task.cancel()

    asyncio.run(main())


def test_abort_and_duplicate_ids():
    async def main():
        engine = make_engine()
        session = engine.attach(registration("w"), FakeWorker())
        task = asyncio.create_task(engine.run_worker(session))
        state = make_state("r", [1, 2, 3], 400)
        engine.submit(state)
        from scheduler_svc.core import RequestRejected

        with pytest.raises(RequestRejected, match="already in flight"):
            engine.submit(make_state("r", [1], 1))
        first = await asyncio.wait_for(state.queue.get(), 10)
        assert first.finish_reason is None
        assert engine.abort("r") is True
        assert engine.abort("r") is False
        tokens, deltas = await drain(state)
        assert len(first.token_ids) + len(tokens) < 400
        assert deltas[-1].finish_reason == FinishReason.ABORT
        task.cancel()

    asyncio.run(main())
