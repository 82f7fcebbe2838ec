"""Front-ends apart from the scheduler: a SchedulerLink (frontend_svc) talks to a real
FrontendLinkService over loopback gRPC, in front of a ServingEngine with a fake worker. Tokens
stream through; stop strings end requests on the front-end and free them on the leader; a
leader that goes away and comes back gets every request in flight again and each stream goes
on with no token lost or repeated; a front-end without a leader fails its requests within its
bound; a new leader adopts the rows a worker reports instead of recomputing them."""

from __future__ import annotations

import asyncio
import functools

import grpc
import pytest

from common.pb import frontend_link_pb2_grpc
from frontend_svc.leader_finder import FixedLeader
from frontend_svc.scheduler_link import FrontendIdentity, SchedulerLink
from scheduler_svc.core import FinishReason, RequestRejected
from scheduler_svc.engine.worker_session import HeldRequest
from scheduler_svc.ha.cluster_view import SchedulerRole
from scheduler_svc.links.frontend_link import FrontendLinkService
from tests.e2e.procs import free_port
from tests.engine_fakes import (
    FakeWorker,
    drain,
    make_engine,
    make_state,
    reference,
    registration,
    run_session,
)


def run_async(test):
    @functools.wraps(test)
    def wrapper() -> None:
        asyncio.run(test())

    return wrapper


class Leader:
    """A FrontendLinkService on a fixed port that can be stopped and started again."""

    def __init__(self, engine, port: int) -> None:
        self.engine = engine
        self.port = port
        self.server: grpc.aio.Server | None = None

    async def start(self) -> None:
        self.server = grpc.aio.server()
        frontend_link_pb2_grpc.add_FrontendLinkServicer_to_server(
            FrontendLinkService(self.engine, SchedulerRole(), 512), self.server
        )
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()

    async def stop(self) -> None:
        assert self.server is not None
        await self.server.stop(0)


def make_link(port: int, leader_wait_timeout: float = 10.0) -> SchedulerLink:
    return SchedulerLink(
        FrontendIdentity("fe-test", "localhost", 1),
        "fake",
        FixedLeader(f"127.0.0.1:{port}"),
        leader_wait_timeout=leader_wait_timeout,
    )


async def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def started(worker: FakeWorker | None = None, port: int | None = None):
    engine = make_engine()
    session = engine.attach(registration("w0"), worker or FakeWorker())
    task = asyncio.create_task(run_session(engine, session))
    leader = Leader(engine, port or free_port())
    await leader.start()
    link = make_link(leader.port)
    await link.start()
    await asyncio.wait_for(link.connected.wait(), 10)
    return engine, session, task, leader, link


@run_async
async def test_tokens_stream_through_and_a_stop_string_frees_the_request_on_the_leader():
    engine, session, task, leader, link = await started()
    try:
        prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
        states = [make_state(f"r{i}", p, 12) for i, p in enumerate(prompts)]
        stop_at = reference(prompts[2], 12)[4]
        states.append(make_state("stopped", prompts[2], 12, stop=[f"<{stop_at}>"]))
        for state in states:
            link.submit(state)
        results = await asyncio.gather(*(drain(s) for s in states))
        for prompt, (tokens, deltas) in zip(prompts, results, strict=False):
            assert tokens == reference(prompt, 12)
            assert deltas[-1].finish_reason == FinishReason.LENGTH
            assert deltas[-1].worker_id == "w0"
        _, deltas = results[3]
        assert deltas[-1].finish_reason == FinishReason.STOP
        shown = reference(prompts[2], 12)[:4]  # the stop string itself is not shown
        assert "".join(d.text for d in deltas) == "".join(f"<{t}>" for t in shown)
        assert deltas[-1].stop_reason == f"<{stop_at}>"
        await wait_for(lambda: not engine.requests and not session.scheduler.running)
        assert session.scheduler.kv.num_free_blocks == 64
        await wait_for(lambda: link.status is not None)
        assert link.server_info(512).workers[0].worker_id == "w0"
        link.requests["dup"] = make_state("dup", [1], 2)  # in flight here
        with pytest.raises(RequestRejected, match="already in flight"):
            link.submit(make_state("dup", [1], 2))
    finally:
        await link.stop()
        await leader.stop()
        task.cancel()


@run_async
async def test_a_leader_that_comes_back_gets_every_request_and_no_token_is_lost_or_repeated():
    worker = FakeWorker()
    engine, session, task, leader, link = await started(worker)
    try:
        prompts = [[21, 22, 23], [24, 25], [26]]
        states = [make_state(f"m{i}", p, 40) for i, p in enumerate(prompts)]
        for state in states:
            link.submit(state)
        await wait_for(lambda: all(len(s.output_token_ids) >= 5 for s in states))
        await leader.stop()  # every stream breaks; the leader drops the front-end's requests
        await wait_for(lambda: not engine.requests)
        await wait_for(lambda: not link.connected.is_set())
        await leader.start()
        results = await asyncio.gather(*(drain(s) for s in states))
        for prompt, (tokens, _) in zip(prompts, results, strict=True):
            assert tokens == reference(prompt, 40)  # each once, in order
        assert link.num_leader_changes == 1
    finally:
        await link.stop()
        await leader.stop()
        task.cancel()


@run_async
async def test_without_a_leader_requests_fail_unavailable_within_the_bound():
    link = make_link(free_port(), leader_wait_timeout=0.5)
    await link.start()
    try:
        waiting = make_state("w", [1, 2], 4)
        link.submit(waiting)
        tokens, deltas = await asyncio.wait_for(drain(waiting), 5)
        assert deltas[-1].finish_reason == FinishReason.ERROR
        assert deltas[-1].error_code == "UNAVAILABLE"
        assert "no scheduler leader answered within 0.5 s" in deltas[-1].error
        late = make_state("late", [1, 2], 4)
        link.submit(late)  # refused at once while the outage lasts
        assert late.queue.get_nowait().error_code == "UNAVAILABLE"
        assert not link.requests
    finally:
        await link.stop()


@run_async
async def test_a_new_leader_adopts_the_rows_a_worker_holds_instead_of_recomputing():
    """The takeover path in the engine: rows reported at registration + requests resumed by a
    front-end; adopted ones are sent as new with their KV counted as computed."""
    engine = make_engine()
    engine.begin_rebuild()
    prompt = [31, 32, 33, 34, 35]
    done = reference(prompt, 6)
    resumed = make_state("a", prompt, 12)
    resumed.output_token_ids = list(done)
    queued = make_state("b", [40, 41], 12)
    queued.output_token_ids = reference([40, 41], 3)
    reg = registration("w0")
    reg.held = [HeldRequest("a", [7, 8, 9], len(prompt) + len(done) - 1, len(prompt) + 6)]
    worker = FakeWorker()
    session = engine.attach(reg, worker)
    assert engine.resume_client([resumed, queued]) == 0  # during the rebuild: nothing placed yet
    assert engine.finish_rebuild() == (2, 1, 2 + 3)
    assert session.scheduler.kv.block_ids("a")[:3] == [7, 8, 9]
    task = asyncio.create_task(run_session(engine, session))
    try:
        (tokens_a, _), (tokens_b, _) = await asyncio.gather(drain(resumed), drain(queued))
        assert done + tokens_a == reference(prompt, 12)
        assert reference([40, 41], 3) + tokens_b == reference([40, 41], 12)
        await wait_for(lambda: not engine.requests)
        assert session.scheduler.kv.num_free_blocks == 64
    finally:
        task.cancel()


@run_async
async def test_a_sibling_of_an_n_group_waits_for_the_first_prompt_across_the_link():
    engine, session, task, leader, link = await started()
    try:
        prompt = list(range(50, 62))  # 3 blocks of 4
        first = make_state("g", prompt, 4)
        sibling = make_state("g-1", prompt, 4)
        sibling.prefill_after = "g"
        link.submit(first)
        link.submit(sibling)
        (a, _), (b, _) = await asyncio.gather(drain(first), drain(sibling))
        assert a == b == reference(prompt, 4)
        assert session.scheduler.stats().prefix_cache_hits == 8  # 2 of the 3 blocks
    finally:
        await link.stop()
        await leader.stop()
        task.cancel()


def test_a_requests_targets_cross_the_link_to_the_leaders_record():
    from scheduler_svc.engine.in_flight import from_submit

    link = make_link(1)
    state = make_state("t", [5, 6, 7], 4)
    state.ttft_target_s, state.tpot_target_s, state.tenant = 0.5, 0.05, "a"
    record = from_submit(link._submit_message(state), sink=None, frontend_id="fe")
    assert (record.ttft_target_s, record.tpot_target_s, record.tenant) == (0.5, 0.05, "a")
    untargeted = from_submit(
        link._submit_message(make_state("u", [5], 4)), sink=None, frontend_id="fe"
    )
    assert (untargeted.ttft_target_s, untargeted.tpot_target_s) == (None, None)


class SlowWorker(FakeWorker):
    """A step takes a few milliseconds: long requests are still running while a test acts."""

    async def execute(self, out):
        await asyncio.sleep(0.004)
        return await FakeWorker.execute(self, out)


@run_async
async def test_a_frontend_cannot_take_over_cancel_or_reprioritise_another_frontends_request():
    from common.link_auth import FRONTEND_ID_METADATA
    from common.pb import frontend_link_pb2 as fpb
    from common.pb import generation_pb2 as gen_pb

    engine, session, task, leader, link = await started(SlowWorker())
    victim = make_state("victim", [5, 6, 7], 200)
    link.submit(victim)
    await wait_for(lambda: len(victim.output_token_ids) >= 3)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{leader.port}")
    stub = frontend_link_pb2_grpc.FrontendLinkStub(channel)
    call = stub.Connect()
    try:
        hijack = fpb.SubmitRequest(request_id="victim", prompt_token_ids=[1, 2], eos_token_id=-1)
        hijack.sampling.max_tokens = 4
        hello = fpb.FrontendHello(frontend_id="fe-other", in_flight=[hijack])
        await call.write(fpb.FrontendMessage(hello=hello))
        seen: list = []
        while not any(u.request_id == "victim" for m in seen for u in m.tokens.updates):
            seen.append(await asyncio.wait_for(call.read(), 10))
        refusal = next(u for m in seen for u in m.tokens.updates if u.request_id == "victim")
        assert refusal.error_code == "ALREADY_EXISTS" and not refusal.token_ids
        await call.write(fpb.FrontendMessage(cancel=fpb.CancelRequest(request_id="victim")))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.SetPriority(
                gen_pb.SetPriorityRequest(request_id="victim", priority=5),
                metadata=((FRONTEND_ID_METADATA, "fe-other"),),
            )
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        tokens, deltas = await asyncio.wait_for(drain(victim), 30)
        assert tokens == reference([5, 6, 7], 200)  # whole, undisturbed
        assert deltas[-1].finish_reason == FinishReason.LENGTH
        assert not session.lost
        assert all(u.request_id != "victim" or u.error for m in seen for u in m.tokens.updates)
        assert not any("victim" in m.tokens.next_request_ids for m in seen)  # no token either
    finally:
        call.cancel()
        await channel.close()
        await link.stop()
        await leader.stop()
        task.cancel()
