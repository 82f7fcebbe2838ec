"""RequestState's delta stream: asyncio.Queue's behaviour for one consumer, woken per put."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_svc.request_state import DeltaStream, StreamDelta


def delta(i: int) -> StreamDelta:
    return StreamDelta(token_ids=[i], text=str(i))


def test_order_and_nowait():
    async def run():
        s = DeltaStream()
        assert s.empty() and s.qsize() == 0
        with pytest.raises(asyncio.QueueEmpty):
            s.get_nowait()
        for i in range(3):
            s.put_nowait(delta(i))
        assert s.qsize() == 3
        assert s.get_nowait().token_ids == [0]
        assert (await s.get()).token_ids == [1]
        assert (await s.get()).token_ids == [2]

    asyncio.run(run())


def test_waiting_consumer_gets_every_delta_in_order():
    async def run():
        s = DeltaStream()
        got = []

        async def consume():
            while len(got) < 50:
                got.append((await s.get()).token_ids[0])

        task = asyncio.create_task(consume())
        for i in range(50):
            s.put_nowait(delta(i))
            if i % 3 == 0:  # sometimes several puts before the consumer runs
                await asyncio.sleep(0)
        await asyncio.wait_for(task, 5)
        assert got == list(range(50))

    asyncio.run(run())


def test_cancelled_getter_passes_its_wake_up_on():
    async def run():
        s = DeltaStream()
        first = asyncio.create_task(s.get())
        second = asyncio.create_task(s.get())
        await asyncio.sleep(0)
        s.put_nowait(delta(1))  # wakes `first`...
        first.cancel()  # ...which is cancelled before it runs
        assert (await asyncio.wait_for(second, 5)).token_ids == [1]
        with pytest.raises(asyncio.CancelledError):
            await first
        # a wait_for timeout leaves nothing behind
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(s.get(), 0.01)
        s.put_nowait(delta(2))
        assert (await s.get()).token_ids == [2]

    asyncio.run(run())
