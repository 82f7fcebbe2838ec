"""1,000 concurrent streaming clients against one scheduler with two workers: each request
completes or is refused at once; no stream hangs; the scheduler's memory stays bounded."""

from __future__ import annotations

import asyncio
import time

import grpc
import psutil
import pytest

from common.client import build_request
from common.pb import generation_pb2_grpc as pb_grpc
from tests.e2e.procs import Cluster

pytestmark = [pytest.mark.e2e]
CLIENTS = 1000


async def one(stub, i: int, max_tokens: int) -> tuple[str, float]:
    started = time.monotonic()
    request = build_request(
        token_ids=[3 + i % 500, 7, 9, 11], max_tokens=max_tokens, ignore_eos=True, temperature=0.0
    )
    tokens = 0
    try:
        async for msg in stub.Generate(request, timeout=120):
            tokens += len(msg.token_ids)
            if msg.finish_reason:
                assert tokens == max_tokens
                return "done", time.monotonic() - started
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return "refused", time.monotonic() - started
        return f"error:{exc.code().name}:{exc.details()}", time.monotonic() - started
    return "no-finish", time.monotonic() - started


async def storm(target: str) -> list[tuple[str, float]]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        return await asyncio.gather(*(one(stub, i, 32) for i in range(CLIENTS)))


def test_thousand_concurrent_streams(tmp_path):
    c = Cluster(tmp_path)
    try:
        sched = c.start_scheduler(
            "--max-waiting-requests", "100", "--max-num-seqs", "64", "--worker-queue-depth", "32"
        )
        for w in ("o0", "o1"):
            c.start_worker(w, "--simulate", "--sim-step-base-ms", "30")
        from common.client import SplitserveClient

        with SplitserveClient(c.target, timeout=30) as client:
            client.wait_for_workers(2, timeout=60)
        proc = psutil.Process(sched.popen.pid)
        rss_before = proc.memory_info().rss
        started = time.monotonic()
        outcomes = asyncio.run(storm(c.target))
        elapsed = time.monotonic() - started
        rss_after = proc.memory_info().rss
        kinds = {k: sum(1 for o, _ in outcomes if o == k) for k in {o for o, _ in outcomes}}
        assert set(kinds) <= {"done", "refused"}, kinds
        assert kinds.get("done", 0) >= 100 and kinds.get("refused", 0) >= 1, kinds
        refusal_times = [t for o, t in outcomes if o == "refused"]
        assert max(refusal_times) < 10, "refusals must come at once, not after waiting"
        assert rss_after - rss_before < 300 * 2**20, (rss_before, rss_after)
        print(
            f"{CLIENTS} clients in {elapsed:.1f} s: {kinds}; scheduler RSS "
            f"{rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB"
        )
        with SplitserveClient(c.target, timeout=30) as client:
            info = client.server_info()
            assert info.num_requests_in_flight == 0
            assert all(w.num_free_blocks == w.num_blocks for w in info.workers)
    except BaseException:
        print(c.logs())
        raise
    finally:
        c.stop_all()
