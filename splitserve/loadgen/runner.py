"""The run: requests sent as a Poisson process (--request-rate) and/or under a concurrency cap
(--max-concurrency), the results summarized."""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time

from splitserve.loadgen.backends import GrpcBackend, OpenAIBackend
from splitserve.loadgen.dataset import BenchRequest
from splitserve.loadgen.report import summarize
from splitserve.loadgen.results import RequestResult


async def run_benchmark(args: argparse.Namespace, requests: list[BenchRequest]) -> dict:
    backend = GrpcBackend(args) if args.backend == "grpc" else OpenAIBackend(args)
    try:
        model = await backend.check()
        progress = None
        if not args.no_progress:
            from tqdm import tqdm

            progress = tqdm(total=len(requests), desc="requests", unit="req", file=sys.stderr)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        rng = random.Random(args.seed + 1)

        async def one(req: BenchRequest) -> RequestResult:
            if sem is None:
                result = await backend.send(req, t0)
            else:
                async with sem:
                    result = await backend.send(req, t0)
            if progress is not None:
                progress.update(1)
            return result

        t0 = time.perf_counter()
        tasks = []
        for i, req in enumerate(requests):
            if i and math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        if progress is not None:
            progress.close()
    finally:
        await backend.close()
    return summarize(args, model, results, duration)
