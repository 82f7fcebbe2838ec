"""Swap preemption with real processes and the real model: `splitserve scheduler
--preemption-mode swap` and a SmolLM2 worker with host blocks and a small device pool.
Requests that run together get preempted and swapped; their greedy outputs equal those of the
same prompts run one at a time (no preemption). A SetPriority call on a finished id is NOT_FOUND.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.client import SplitserveClient
from common.pb import generation_pb2 as pb
from common.pb import generation_pb2_grpc as pb_grpc
from tests.e2e.procs import Cluster

pytestmark = [pytest.mark.e2e]

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("swap"))
    c.start_scheduler(
        "--preemption-mode",
        "swap",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "128",
        "--max-model-len",
        "512",
    )
    # 20 blocks of 16 = 320 tokens; six requests of ~40 + 24 tokens need ~400 together
    c.start_worker("w0", "--num-gpu-blocks", "20", "--num-host-blocks", "64")
    try:
        with SplitserveClient(c.target) as client:
            client.wait_for_workers(1, timeout=120)
        yield c
    except BaseException:
        print(c.logs())
        raise
    finally:
        c.stop_all()


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(30, 50))] for _ in range(6)]


def run(client: SplitserveClient, prompt: list[int]) -> list[int]:
    result = client.generate(
        token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
    )
    assert result.finish_reason == "length"
    return result.token_ids


def test_swapped_requests_generate_what_they_generate_alone(cluster):
    plist = prompts()
    with SplitserveClient(cluster.target, timeout=120) as client:
        with ThreadPoolExecutor(len(plist)) as pool:
            together = list(pool.map(lambda p: run(client, p), plist))
        (worker,) = client.server_info().workers
        assert worker.num_preemptions > 0 and worker.num_swap_outs > 0, worker
        assert worker.num_recomputed_tokens == 0  # swapped, not recomputed
        alone = [run(client, p) for p in plist]  # one at a time: nothing is preempted
        assert client.server_info().workers[0].num_preemptions == worker.num_preemptions
    assert together == alone
    assert "costs_measured" in cluster.procs[-1].log()  # the worker timed prefill and copies


def test_set_priority_of_an_unknown_request_is_not_found(cluster):
    with grpc.insecure_channel(cluster.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.SetPriority(pb.SetPriorityRequest(request_id="nope", priority=1), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
