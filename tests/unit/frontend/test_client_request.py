"""ClientRequest's delta stream: asyncio.Queue's behaviour for one consumer, woken per put."""

from __future__ import annotations

import asyncio

import pytest

from frontend_svc.client_request import DeltaStream, StreamDelta


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


@pytest.mark.parametrize("stop", [[], ["lo w"]])
@pytest.mark.parametrize("table", [True, False])
def test_push_token_streams_what_push_tokens_streams(stop, table):
    """The step loop's one-token fast path gives the same deltas and state as the general
    one: byte table or not, stop strings, characters split over tokens, a finished request."""
    from common.messages import SamplingParams
    from common.tokenizer import load_tokenizer
    from frontend_svc.client_request import ClientRequest
    from frontend_svc.detokenizer import IncrementalDetokenizer

    tok = load_tokenizer(None)
    decoder = tok if table else type("Plain", (), {"decode": staticmethod(tok.decode)})()
    pieces = tok.byte_pieces().pieces
    split = [i for i, p in enumerate(pieces) if p in (b"\xf0", b"\x9f", b"\x8e", b"\x89")]
    ids = tok.encode("Hello world, hello again") + split + tok.encode(" done")

    def state():
        detok = IncrementalDetokenizer.for_prompt(decoder, [1], True, list(stop))
        return ClientRequest("r", [1], SamplingParams(max_tokens=100), detok, worker_id="w0")

    fast, general = state(), state()
    for step, token_id in enumerate(ids):
        now = 100.0 + step
        assert fast.push_token([token_id], now) == general.push_tokens(
            [token_id], None, None, None, now
        )
    deltas = []
    for s in (fast, general):
        items = []
        while not s.queue.empty():
            d = s.queue.get_nowait()
            items.append(
                (
                    d.token_ids,
                    d.text,
                    d.finish_reason,
                    d.stop_reason,
                    d.num_output_tokens,
                    d.worker_id,
                )
            )
        deltas.append(items)
    assert deltas[0] == deltas[1] and deltas[0]
    assert fast.output_token_ids == general.output_token_ids
    assert (fast.first_token_time, fast.last_token_time, fast.finish_reason) == (
        general.first_token_time,
        general.last_token_time,
        general.finish_reason,
    )
    if stop:
        assert fast.finish_reason is not None  # "lo w" in "Hello world"
        assert len(deltas[0]) < len(ids)  # nothing streamed after the stop


def test_held_tokens_go_with_the_last_delta_of_any_ending():
    """With a stream interval, tokens that wait are not lost when the request finishes,
    is aborted or fails: the last delta carries them."""
    from common.messages import SamplingParams
    from common.tokenizer import load_tokenizer
    from frontend_svc.client_request import ClientRequest
    from frontend_svc.detokenizer import IncrementalDetokenizer
    from scheduler_svc.core.request import FinishReason

    tok = load_tokenizer(None)
    ids = tok.encode("one two three four five six")
    for ending in ("length", "abort", "fail"):
        detok = IncrementalDetokenizer.for_prompt(tok, [1], True, [])
        state = ClientRequest("r", [1], SamplingParams(max_tokens=50), detok, stream_interval=4)
        for i, t in enumerate(ids[:-1]):
            state.push_token([t], float(i))
        if ending == "length":
            state.push_tokens([ids[-1]], FinishReason.LENGTH, None, None, 99.0)
        elif ending == "abort":
            state.end_aborted()
        else:
            state.fail("boom", "INTERNAL")
        deltas = []
        while not state.queue.empty():
            deltas.append(state.queue.get_nowait())
        sent = ids if ending == "length" else ids[:-1]
        assert [t for d in deltas for t in d.token_ids] == sent
        assert "".join(d.text for d in deltas) == tok.decode(sent)
        assert [len(d.token_ids) for d in deltas][:2] == [1, 4]
        assert deltas[-1].finish_reason is not None and not state.held_token_ids


@pytest.mark.parametrize("fast", [True, False])
def test_tokens_held_when_the_interval_drops_go_first_with_the_next(fast):
    """The adaptive interval may fall while a token is held: it goes out before the next token,
    in order (the fast path once sent the new token alone, and the held newline came out at
    the end: " Paris.\nThe answer is\n:" for " Paris.\n\nThe answer is:")."""
    from common.messages import SamplingParams
    from common.tokenizer import load_tokenizer
    from frontend_svc.client_request import ClientRequest
    from frontend_svc.detokenizer import IncrementalDetokenizer
    from scheduler_svc.core.request import FinishReason

    tok = load_tokenizer(None)
    text = " Paris.\n\nThe answer is:"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer.for_prompt(tok, [1], True, [])
    state = ClientRequest("r", [1], SamplingParams(max_tokens=50), detok, stream_interval=4)
    for i, t in enumerate(ids[:-1]):
        if i == 3:  # tokens 1 and 2 are held
            state.set_stream_interval(1)
        if fast:
            state.push_token([t], float(i))
        else:
            state.push_tokens([t], None, None, None, float(i))
    state.push_tokens([ids[-1]], FinishReason.LENGTH, None, None, 99.0)
    deltas = []
    while not state.queue.empty():
        deltas.append(state.queue.get_nowait())
    assert [d.token_ids for d in deltas][:3] == [ids[:1], ids[1:4], ids[4:5]]
    assert [t for d in deltas for t in d.token_ids] == ids
    assert "".join(d.text for d in deltas) == text


def test_a_consumer_behind_takes_the_backlog_as_one_delta():
    from scheduler_svc.core.request import FinishReason

    s = DeltaStream()
    for i in range(3):
        s.put_nowait(StreamDelta([i], f"t{i}", num_output_tokens=i + 1, worker_id="w0"))
    s.put_nowait(StreamDelta([3], "t3", FinishReason.LENGTH, num_output_tokens=4))
    s.put_nowait(StreamDelta([9], "never"))  # nothing is merged past the end
    merged = s.take_merged(s.get_nowait())
    assert merged.token_ids == [0, 1, 2, 3] and merged.text == "t0t1t2t3"
    assert merged.finish_reason is FinishReason.LENGTH and merged.num_output_tokens == 4
    assert s.qsize() == 1
    # an error is not merged into the tokens before it: those still go out first
    s = DeltaStream()
    s.put_nowait(StreamDelta([1], "a"))
    s.put_nowait(StreamDelta([2], "b"))
    s.put_nowait(StreamDelta([], "", FinishReason.ERROR, error="lost", error_code="UNAVAILABLE"))
    first = s.take_merged(s.get_nowait())
    assert first.token_ids == [1, 2] and not first.error_code
    assert s.take_merged(s.get_nowait()).error_code == "UNAVAILABLE"
    # nothing queued behind: the delta itself
    only = StreamDelta([5], "x")
    assert DeltaStream().take_merged(only) is only
