"""The scheduler service's work per request per step, in one process and without sockets: the
engine's step loop for W workers x R running requests, each step encoded to the wire bytes a
worker would get and answered with the wire bytes a worker would send (a token per request, made
by the simulated worker's rule, at once: no forward time), delivered to R streams whose
consumers are asyncio tasks, as the client handlers are. Reports scheduler CPU per request-step
with the worker side's part (decoding the step, answering it) timed apart and taken out: the
number bench/scale_sim.py measures across processes, without their noise.

    .venv/bin/python bench/step_pipeline.py                      # 16 x 256, both loops
    .venv/bin/python bench/step_pipeline.py --workers 4 --running 64 --steps 400 --profile
    # a step shard's work (#38): the leader's placements in, each step's updates packed per
    # front-end into the report the shard writes to its leader (serialized, not sent)
    .venv/bin/python bench/step_pipeline.py --role shard
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import random
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import event_loop  # noqa: E402
from common.convert import (  # noqa: E402
    HandleTable,
    decode_step,
    decode_step_result,
    encode_step,
    encode_step_result,
)
from common.logging import configure_logging  # noqa: E402
from common.pb import shard_link_pb2 as shard_pb  # noqa: E402
from common.pb import worker_link_pb2 as pb  # noqa: E402
from common.tokenizer import load_tokenizer  # noqa: E402
from frontend_svc.intake import Intake  # noqa: E402
from scheduler_svc.config import SchedulerServiceConfig  # noqa: E402
from scheduler_svc.core import SamplingParams, restore_gc, tune_gc_for_serving  # noqa: E402
from scheduler_svc.engine.in_flight import to_submit  # noqa: E402
from scheduler_svc.engine.serving_engine import ServingEngine  # noqa: E402
from scheduler_svc.engine.worker_session import StepReply, WorkerRegistration  # noqa: E402
from scheduler_svc.obs.engine_observer import ObserverGroup  # noqa: E402
from scheduler_svc.shards.shard_agent import ShardAgent  # noqa: E402
from splitserve.embedded import InProcessScheduler  # noqa: E402
from worker_svc.sim_runner import sim_next_token  # noqa: E402


class WireWorker:
    """A transport that does what the gRPC one does to a step (encode, serialize; parse and check
    the answer) and what a simulated worker does in between, the latter timed apart."""

    def __init__(self, vocab_size: int) -> None:
        self.handles = HandleTable()
        self.vocab_size = vocab_size
        self.tokens: dict[str, list[int]] = {}
        self.worker_s = 0.0  # process time spent on the worker's side
        self.finished: dict[int, list[int]] = {}  # step id -> handles it finished

    async def submit(self, out):
        message = pb.SchedulerMessage()
        encode_step(out, self.handles, release=False, into=message.step)
        self.finished[out.step_id] = list(message.step.finished)
        wire = message.SerializeToString()
        started = time.process_time()
        step = pb.SchedulerMessage.FromString(wire).step
        so = decode_step(step)
        for rid in so.finished_req_ids:
            self.tokens.pop(rid, None)
        for new in so.new_requests:
            self.tokens[new.request_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
        sampled = {}
        for rid in so.num_scheduled_tokens:
            seq = self.tokens[rid]
            tok = sim_next_token(seq, self.vocab_size)
            seq.append(tok)
            sampled[rid] = [tok]
        reply = pb.WorkerMessage(step_result=encode_step_result(step.step_id, sampled))
        answer = reply.SerializeToString()
        self.worker_s += time.process_time() - started
        return answer

    async def result(self, out, answer) -> StepReply:
        result = pb.WorkerMessage.FromString(answer).step_result
        sampled, logprobs = decode_step_result(result, self.handles, self.vocab_size)
        self.handles.release_handles(self.finished.pop(out.step_id, ()))
        await asyncio.sleep(0)  # the socket read: the stream consumers run in between
        return StepReply(sampled, logprobs)


async def drain(state) -> None:
    while True:
        delta = await state.queue.get()
        if delta.finish_reason is not None:
            return


async def write_reports(outbox: asyncio.Queue) -> None:
    """What the shard's link does to a report: serialize it (the socket write left out)."""
    while True:
        (await outbox.get()).SerializeToString()


async def run(args, kind: str) -> dict:
    tokenizer = load_tokenizer(None)
    cfg = SchedulerServiceConfig(
        max_num_seqs=args.running,
        max_num_batched_tokens=4096,
        max_model_len=8192,
        worker_queue_depth=args.running,
        stream_interval=args.stream_interval,
    )
    engine = ServingEngine(cfg, "sim", tokenizer.vocab_size)
    intake = Intake(tokenizer, "sim", set(), cfg.max_model_len)
    workers = []
    for i in range(args.workers):
        transport = WireWorker(tokenizer.vocab_size)
        reg = WorkerRegistration(f"w{i}", "sim", 16, args.running * 40, 0, 8192)
        workers.append((engine.attach(reg, transport), transport))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.steps + 50, temperature=0.0, ignore_eos=True)
    tasks = []
    front = InProcessScheduler(engine)  # the in-process front-end's side of the engine
    agent = None
    if args.role == "shard":
        agent = ShardAgent(engine, "s0", "", lambda address: None, lambda epoch: None)
        engine.observer = ObserverGroup(engine.observer, agent)
        agent.outbox = asyncio.Queue()
        tasks.append(asyncio.create_task(write_reports(agent.outbox)))
        for session, _ in workers:
            agent.on_worker_attached(session)
    for i in range(args.workers * args.running):
        prompt = [rng.randrange(3, tokenizer.vocab_size) for _ in range(32)]
        state = intake.make_state(f"r{i}", prompt, params, [])
        if agent is not None:
            worker_id = workers[i % len(workers)][0].worker_id
            agent._assign(
                shard_pb.AssignRequest(
                    worker_id=worker_id, frontend_id=f"fe{i % 4}", request=to_submit(state)
                )
            )
            continue
        front.submit(state)
        tasks.append(asyncio.create_task(drain(state)))
    loops = [asyncio.create_task(engine.run_worker(s)) for s, _ in workers]
    sessions = [s for s, _ in workers]
    while min(s.num_steps for s in sessions) < args.warmup:
        await asyncio.sleep(0)
    steps0 = sum(s.num_steps for s in sessions)
    worker0 = sum(t.worker_s for _, t in workers)
    profiler = cProfile.Profile() if args.profile else None
    cpu0 = time.process_time()
    if profiler:
        profiler.enable()
    while min(s.num_steps for s in sessions) < args.warmup + args.steps:
        await asyncio.sleep(0.01)
    if profiler:
        profiler.disable()
    cpu = time.process_time() - cpu0
    steps = sum(s.num_steps for s in sessions) - steps0
    worker_s = sum(t.worker_s for _, t in workers) - worker0
    for state in list(engine.requests.values()):
        engine.abort(state.request_id)
    if agent is not None:
        tasks[0].cancel()
    await asyncio.gather(*tasks, return_exceptions=agent is not None)
    for s in sessions:
        s.mark_lost("benchmark over")
    await asyncio.gather(*loops)
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    request_steps = steps * args.running
    return {
        "event_loop": event_loop.loop_name(),
        "workers": args.workers,
        "running_per_worker": args.running,
        "request_steps": request_steps,
        "scheduler_us_per_request_step": 1e6 * (cpu - worker_s) / request_steps,
        "worker_side_us_per_request_step": 1e6 * worker_s / request_steps,
        "request_steps_per_core_s": request_steps / max(cpu - worker_s, 1e-9),
        "stream_interval": args.stream_interval,
        "role": args.role,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60, help="measured steps per worker")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--loops", nargs="+", default=["uvloop", "asyncio"], choices=["uvloop", "asyncio"]
    )
    parser.add_argument("--repeats", type=int, default=3, help="best of")
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="cProfile the measured steps")
    parser.add_argument(
        "--role",
        choices=["single", "shard"],
        default="single",
        help="single: the scheduler with its streams; shard: a step shard reporting to a leader",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    configure_logging("warning", json_logs=True)
    gc_before = tune_gc_for_serving()
    rows = []
    try:
        for kind in args.loops:
            runs = [event_loop.run(run(args, kind), kind) for _ in range(args.repeats)]
            rows.append(min(runs, key=lambda r: r["scheduler_us_per_request_step"]))
    finally:
        restore_gc(gc_before)
    table = Table(
        title=f"{args.role} scheduler work per request-step, {args.workers} x {args.running} "
        f"running, stream interval {args.stream_interval}, in one process "
        f"(best of {args.repeats})"
    )
    for col in (
        "loop",
        "request-steps",
        "scheduler µs",
        "worker side µs (taken out)",
        "request-steps per core-s",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["event_loop"],
            str(r["request_steps"]),
            f"{r['scheduler_us_per_request_step']:.2f}",
            f"{r['worker_side_us_per_request_step']:.2f}",
            f"{r['request_steps_per_core_s']:,.0f}",
        )
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
