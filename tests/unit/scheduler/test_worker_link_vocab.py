"""Workers are held to the scheduler's own vocabulary, read from the model itself (issue #35,
problem 4): one that registers another vocabulary size is refused; one that answers a token id
at or past it (also as a top logprob id) is cut off, nothing of that step is applied or
streamed, and its requests finish on the other workers with the tokens they would have had.
No token id a worker could not have sampled reaches a worker, whichever way a request comes
back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct

import grpc
import pytest

from common.convert import (
    HandleTable,
    TokenLogprobs,
    decode_step,
    decode_step_result,
    encode_step_result,
)
from common.model_source import read_vocab_size, resolve_model
from common.pb import worker_link_pb2 as pb
from common.pb import worker_link_pb2_grpc as pb_grpc
from scheduler_svc.core import FinishReason, RequestRejected
from scheduler_svc.links.worker_link import WorkerLinkService
from scheduler_svc.obs.engine_observer import EngineObserver
from tests.engine_fakes import (
    VOCAB,
    FakeWorker,
    drain,
    make_engine,
    make_state,
    reference,
    registration,
    run_session,
)


def register(vocab_size: int = VOCAB) -> pb.WorkerMessage:
    return pb.WorkerMessage(
        register=pb.Register(
            worker_id="rogue",
            model="fake",
            block_size=4,
            num_device_blocks=64,
            max_model_len=512,
            vocab_size=vocab_size,
        )
    )


@contextlib.asynccontextmanager
async def worker_link(engine):
    server = grpc.aio.server()
    pb_grpc.add_WorkerLinkServicer_to_server(WorkerLinkService(engine), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield pb_grpc.WorkerLinkStub(channel)
    finally:
        await server.stop(0)


class Detaches(EngineObserver):
    def __init__(self) -> None:
        self.detached: list[tuple[str, str]] = []

    def on_worker_detached(self, session, reason: str) -> None:
        self.detached.append((session.worker_id, reason))


@pytest.mark.parametrize("declared", [0, VOCAB - 1, VOCAB + 1, 2**31])
def test_a_worker_declaring_another_vocabulary_is_refused(declared):
    async def main():
        engine = make_engine()
        async with worker_link(engine) as stub:
            call = stub.Connect()
            await call.write(register(declared))
            with contextlib.suppress(grpc.aio.AioRpcError):
                assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.INVALID_ARGUMENT
            details = await call.details()
            assert f"vocabulary of {declared} tokens" in details and str(VOCAB) in details
        assert not engine.sessions

    asyncio.run(main())


async def poisoning_worker(stub, poison_at: int, where: str, bad_id: int) -> None:
    """Registers right and answers as FakeWorker does, except that its `poison_at`-th step
    answers `bad_id` for one request: as its sampled token, or as a top logprob id."""
    call = stub.Connect()
    await call.write(register())
    assert (await call.read()).WhichOneof("msg") == "register_ack"
    model = FakeWorker()
    steps = 0
    # the scheduler ends the stream: as an error on a read, or a write after the end
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
        while (msg := await call.read()) is not grpc.aio.EOF:
            if msg.WhichOneof("msg") != "step":
                continue
            reply = await model.execute(decode_step(msg.step))
            sampled, logprobs = reply.sampled, None
            steps += 1
            if steps == poison_at:
                victim = next(rid for rid, tokens in sampled.items() if tokens)
                if where == "token":
                    sampled = {**sampled, victim: [bad_id]}
                else:
                    top = [(bad_id, -0.5)]
                    logprobs = {victim: [TokenLogprobs(sampled[victim][0], -0.5, top)]}
            result = encode_step_result(msg.step.step_id, sampled, logprobs)
            await call.write(pb.WorkerMessage(step_result=result))


@pytest.mark.parametrize(
    "where,bad_id", [("token", VOCAB), ("token", 999_999_999), ("top logprob", VOCAB)]
)
def test_an_impossible_token_cuts_its_worker_off_and_its_requests_finish_elsewhere(where, bad_id):
    async def main():
        engine = make_engine()
        engine.observer = observer = Detaches()
        async with worker_link(engine) as stub:
            rogue = asyncio.create_task(poisoning_worker(stub, 3, where, bad_id))
            while "rogue" not in engine.sessions:
                await asyncio.sleep(0.01)
            good = engine.attach(registration("good"), FakeWorker())
            good_loop = asyncio.create_task(run_session(engine, good))
            states = [make_state(f"r{i}", [40 + i, 41, 42, 43], 12) for i in range(6)]
            for state in states:
                engine.submit(state)
            on_rogue = [s for s in states if engine.record(s).worker_id == "rogue"]
            assert on_rogue and len(on_rogue) < len(states)
            results = await asyncio.gather(*(drain(s) for s in states))
            for state, (tokens, deltas) in zip(states, results, strict=True):
                assert tokens == reference(state.prompt_token_ids, 12)
                assert deltas[-1].finish_reason == FinishReason.LENGTH
                assert all(lp.token_id < VOCAB for d in deltas for lp in d.logprobs or ())
            assert all(engine.record(s).num_migrations == 1 for s in on_rogue)
            [(worker_id, reason)] = observer.detached
            assert worker_id == "rogue" and "vocabulary size 1000" in reason
            assert engine.sessions["good"] is good and not good.lost
            await rogue
            good.mark_lost("test over")
            await good_loop

    asyncio.run(main())


def test_logprobs_of_the_wrong_shape_are_a_wrong_answer_not_a_crash():
    handles = HandleTable()
    handle = handles.assign("r")
    result = pb.StepResult(step_id=1)
    result.sampled.add(handle=handle, token_ids=[5, 6], logprobs=[-0.1])  # one logprob short
    with pytest.raises(ValueError, match="wrong shape"):
        decode_step_result(result, handles, VOCAB, {"r": [6]})


def test_token_ids_outside_the_vocabulary_never_reach_a_worker_from_a_front_end():
    """A front-end's prompt, or after a takeover the tokens its client already has (an older
    leader took them from a worker), are checked before any worker sees them."""

    async def main():
        engine = make_engine()
        worker = engine.attach(registration("w"), FakeWorker())  # fails a step on a bad id
        loop = asyncio.create_task(run_session(engine, worker))
        with pytest.raises(RequestRejected, match="outside the model's vocabulary"):
            engine.submit(make_state("bad-prompt", [5, VOCAB], 4))
        moved = make_state("bad-output", [5, 6], 4)
        moved.output_token_ids = [7, 999_999_999]
        engine.resume_client([moved])
        _, deltas = await drain(moved)
        assert deltas[-1].error_code == "INVALID_ARGUMENT" and "vocabulary" in deltas[-1].error
        fine = make_state("fine", [5, 6], 4)
        engine.submit(fine)
        tokens, _ = await drain(fine)
        assert tokens == reference([5, 6], 4) and not worker.lost
        worker.mark_lost("test over")
        await loop

    asyncio.run(main())


def gguf_file(path, metadata: dict) -> None:
    """A GGUF file holding only `metadata` (strings, uint32s and string arrays)."""

    def string(text: str) -> bytes:
        raw = text.encode()
        return struct.pack("<Q", len(raw)) + raw

    body = b""
    for key, value in metadata.items():
        body += string(key)
        if isinstance(value, str):
            body += struct.pack("<I", 8) + string(value)
        elif isinstance(value, int):
            body += struct.pack("<II", 4, value)
        else:
            body += struct.pack("<IIQ", 9, 8, len(value)) + b"".join(map(string, value))
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(metadata)) + body)


def test_the_vocabulary_size_is_read_from_the_model_itself(tmp_path):
    assert read_vocab_size(resolve_model(None)) == 49152  # SmolLM2's GGUF states it
    listed = tmp_path / "listed.gguf"  # no <arch>.vocab_size: as many as the tokens listed
    gguf_file(listed, {"general.architecture": "llama", "tokenizer.ggml.tokens": ["a", "b"]})
    assert read_vocab_size(resolve_model(listed)) == 2
    stated = tmp_path / "stated.gguf"
    gguf_file(stated, {"general.architecture": "qwen2", "qwen2.vocab_size": 7})
    assert read_vocab_size(resolve_model(stated)) == 7
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"")
    (hf / "config.json").write_text(json.dumps({"vocab_size": 321}))
    assert read_vocab_size(resolve_model(hf)) == 321
    (hf / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 654}}))
    assert read_vocab_size(resolve_model(hf)) == 654
    (hf / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no vocabulary size"):
        read_vocab_size(resolve_model(hf))
