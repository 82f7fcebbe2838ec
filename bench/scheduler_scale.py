"""Does the scheduler tier grow with its workers? A leader (`splitserve scheduler
--no-client-api`: global queue, admission, placement) and S step shards (`splitserve shard`:
the core schedulers and step loops of a subset of the workers), against W simulated workers
(no model: each step answers after --step-ms) spread round-robin over the shards. S = 0 is the
single-process scheduler of today (the workers dial the leader), the baseline.

Each worker keeps R requests running (ignore_eos, max_tokens filling --max-model-len, which
outlasts a run at --step-ms 10; one that ends is sent again). After a warm-up, a measured window
gives, per shard count:

- request-steps/s of the tier: the rows that got a token, summed over the workers' steps. The
  workers count them: each worker here is the real `splitserve worker --simulate` process with
  a trace of its link's steps (`worker-trace` below wraps WorkerLinkClient._execute and appends
  "time rows idle" per step to a file), so the count holds whatever the shards serve.
- the step latency the tier adds: the worker's idle gap between sending a result and receiving
  its next step (StepResult.idle_time_s, as bench/scale_sim.py sums it), p50 / p99 / mean.
- CPU per request-step of each tier process kind (leader, shards summed, each shard in the
  JSON), from /proc/PID/stat utime + stime over the window, and the cores the tier would need
  for 64 workers x 256 rows at 10 ms steps (1.64M request-steps/s).

The clients (--client):

- `link` (the default): this process is the front-end. It holds one FrontendLink stream to the
  leader's internal port (the worker port, plaintext on loopback), says FrontendHello, reads
  the cluster status until every worker is listed, then submits the W x R requests as
  SubmitRequests and from then on reads the LeaderMessages as raw bytes, never parsed: it
  counts messages and bytes ("link B/rs": bytes per request-step; it holds steady while the
  tokens keep up). No `splitserve frontend` process, so the tier gets the machine's cores.
  The requests never end within a point: nothing resubmits one that does.
- `grpc`: the W x R streams over the public gRPC API (common/client.py's request, grpc.aio on
  one thread), through --frontends `splitserve frontend` processes sharing one port (default
  1: its CPU per request-step is in the table; raise it if it saturates). "delivered %" is the
  tokens they got per request-step in the window: below 100 the token path (shard -> leader ->
  front-end -> client) falls behind the steps, above it a backlog drains.

"client µs/rs" is this process's CPU (either mode), "workers µs/rs" the simulated workers' (the
`splitserve worker --simulate` processes with their trace, summed): on a small machine they
share the cores with the tier, and the table's "cores busy" says whether it was saturated.

    .venv/bin/python bench/scheduler_scale.py --shards 0 1 2 --workers 16 --running 256 \\
        --step-ms 10 --seconds 15 --json out.json
    .venv/bin/python bench/scheduler_scale.py --shards 0 --workers 4 --running 64 --verbose
    .venv/bin/python bench/scheduler_scale.py --client grpc --frontends 2 --shards 0 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import runpy
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CLI = [sys.executable, "-m", "splitserve.cli"]
TRACE_FLUSH_S = 0.25
# the cluster the tier is sized for: workers x rows per worker / seconds per step
TARGET_REQUEST_STEPS_PER_S = 64 * 256 / 0.010


def worker_trace(trace_path: str, worker_argv: list[str]) -> None:
    """Runs `splitserve worker ARGS` in this process, appending "monotonic-time rows idle-s"
    for each step the link answers to `trace_path` (flushed every TRACE_FLUSH_S)."""
    from worker_svc import link

    records: list[tuple[float, int, float]] = []
    execute = link.WorkerLinkClient._execute

    def traced(self, step):
        reply = execute(self, step)
        rows = len(reply.sampled_handles) + sum(1 for s in reply.sampled if s.token_ids)
        records.append((time.monotonic(), rows, reply.idle_time_s))
        return reply

    def flush() -> None:
        with open(trace_path, "a", buffering=1) as out:
            while True:
                time.sleep(TRACE_FLUSH_S)
                taken = records[:]
                del records[: len(taken)]
                out.write("".join(f"{t:.6f} {n} {idle:.6f}\n" for t, n, idle in taken))

    link.WorkerLinkClient._execute = traced
    threading.Thread(target=flush, daemon=True).start()
    sys.argv = ["splitserve", "worker", *worker_argv]
    runpy.run_module("splitserve.cli", run_name="__main__")


def read_trace(path: Path) -> list[tuple[float, int, float]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        parts = line.split()
        if len(parts) == 3:  # a line being written is not complete yet
            out.append((float(parts[0]), int(parts[1]), float(parts[2])))
    return out


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def self_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Child:
    kind: str  # leader, shard, frontend, worker
    name: str
    proc: subprocess.Popen
    log: Path


@dataclass
class Tier:
    """The processes of one point; stop() ends them all (workers first)."""

    tmp: Path
    verbose: bool
    children: list[Child] = field(default_factory=list)

    def spawn(self, kind: str, name: str, argv: list[str]) -> Child:
        log = self.tmp / f"{name}.log"
        if self.verbose:
            print(shlex.join(argv), flush=True)
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            stdout=open(log, "wb"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        child = Child(kind, name, proc, log)
        self.children.append(child)
        return child

    def of(self, kind: str) -> list[Child]:
        return [c for c in self.children if c.kind == kind]

    def check_alive(self) -> None:
        for c in self.children:
            if c.proc.poll() is not None:
                tail = "\n".join(c.log.read_text(errors="replace").splitlines()[-15:])
                raise RuntimeError(
                    f"{c.name} exited with {c.proc.returncode}:\n{shlex.join(c.proc.args)}\n{tail}"
                )

    def stop(self) -> None:
        order = ("worker", "frontend", "shard", "leader")
        for kind in order:
            group = [c for c in self.of(kind) if c.proc.poll() is None]
            for c in group:  # a worker leaves at once on SIGINT (SIGTERM drains)
                c.proc.send_signal(signal.SIGINT if kind == "worker" else signal.SIGTERM)
            for c in group:
                try:
                    c.proc.wait(10)
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait()
        self.children.clear()


LIVE_TIERS: list[Tier] = []


class Clients:
    """W x R never-ending streams over the public gRPC API, on one asyncio thread."""

    tokens_counted = True

    def __init__(self, target: str, num_streams: int, args) -> None:
        self.target = target
        self.num_streams = num_streams
        self.args = args
        self.tokens = 0
        self.errors: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.stopping: asyncio.Event | None = None
        self.task = None

    def start(self) -> None:
        self.thread.start()
        self.task = asyncio.run_coroutine_threadsafe(self._run(), self.loop)

    def stop(self) -> None:
        if self.stopping is not None:
            self.loop.call_soon_threadsafe(self.stopping.set)
        if self.task is not None:
            try:
                self.task.result(timeout=15)
            except Exception as exc:  # noqa: BLE001 - the point's numbers are already taken
                self.errors.append(f"{type(exc).__name__}: {exc}")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def _run(self) -> None:
        import grpc

        from common.client import build_request
        from common.pb import generation_pb2_grpc as pb_grpc

        self.stopping = asyncio.Event()
        rng = random.Random(0)
        max_tokens = self.args.max_model_len - self.args.prompt_len  # the context, filled
        async with grpc.aio.insecure_channel(self.target) as channel:
            stub = pb_grpc.GenerationStub(channel)

            async def stream(i: int) -> None:
                prompt = [rng.randrange(3, 49152) for _ in range(self.args.prompt_len)]
                while not self.stopping.is_set():
                    request = build_request(
                        token_ids=prompt,
                        request_id=f"s{i}-{time.monotonic_ns()}",
                        max_tokens=max_tokens,
                        temperature=0.0,
                        ignore_eos=True,
                    )
                    call = stub.Generate(request)
                    try:
                        async for msg in call:
                            self.tokens += len(msg.token_ids)
                    except grpc.aio.AioRpcError as exc:
                        if not self.stopping.is_set() and len(self.errors) < 20:
                            self.errors.append(f"stream {i}: {exc.code()} {exc.details()}")
                            await asyncio.sleep(0.5)
                    except asyncio.CancelledError:
                        call.cancel()
                        raise

            tasks = [asyncio.create_task(stream(i)) for i in range(self.num_streams)]
            await self.stopping.wait()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


class LinkClients:
    """This process as the front-end: one FrontendLink stream to the leader (on one asyncio
    thread) carrying the W x R requests. Only the hello_ack and, before the requests go, the
    cluster status (to see the workers attach) are parsed; afterwards each LeaderMessage is
    counted as bytes, unread."""

    tokens_counted = False

    def __init__(self, target: str, num_requests: int, args) -> None:
        self.target = target
        self.num_requests = num_requests
        self.args = args
        self.tokens = 0  # not counted: the messages are not parsed
        self.messages = 0
        self.bytes = 0
        self.workers_listed = -1  # as of the leader's last status before the submits
        self.submitted = False
        self.errors: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.stopping: asyncio.Event | None = None
        self.task = None

    def start(self) -> None:
        self.thread.start()
        self.task = asyncio.run_coroutine_threadsafe(self._run(), self.loop)
        self.task.add_done_callback(self._ended)

    def _ended(self, task) -> None:
        exc = None if task.cancelled() else task.exception()
        if exc is not None and not (self.stopping and self.stopping.is_set()):
            self.errors.append(f"{type(exc).__name__}: {exc}")
        elif not (self.stopping and self.stopping.is_set()):
            self.errors.append("the leader ended the FrontendLink stream")

    def stop(self) -> None:
        if self.stopping is not None:
            self.loop.call_soon_threadsafe(self.stopping.set)
        if self.task is not None:
            # a failure: _ended noted it; the numbers are already taken
            with contextlib.suppress(Exception):
                self.task.result(timeout=15)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def _run(self) -> None:
        import grpc

        from common.convert import sampling_to_proto
        from common.messages import SamplingParams
        from common.pb import frontend_link_pb2 as pb

        self.stopping = asyncio.Event()
        rng = random.Random(0)
        sampling = sampling_to_proto(
            SamplingParams(
                max_tokens=self.args.max_model_len - self.args.prompt_len,  # the context, filled
                temperature=0.0,
                ignore_eos=True,
            )
        )
        options = [
            ("grpc.max_receive_message_length", 256 * 1024 * 1024),
            ("grpc.max_send_message_length", 256 * 1024 * 1024),
        ]
        async with grpc.aio.insecure_channel(self.target, options=options) as channel:
            connect = channel.stream_stream(
                "/splitserve.v1.FrontendLink/Connect",
                request_serializer=pb.FrontendMessage.SerializeToString,
                response_deserializer=None,  # raw bytes
            )
            call = connect(wait_for_ready=True)  # the leader may not listen yet
            try:
                hello = pb.FrontendHello(frontend_id="bench", host="127.0.0.1", pid=os.getpid())
                await call.write(pb.FrontendMessage(hello=hello))
                first = await asyncio.wait_for(call.read(), 120)
                if first is grpc.aio.EOF:
                    raise ConnectionError("the leader ended the stream before its hello_ack")
                if pb.LeaderMessage.FromString(first).WhichOneof("msg") != "hello_ack":
                    raise ConnectionError("the leader's first message is not a hello_ack")
                await self._await_workers(call, pb)
                for i in range(self.num_requests):
                    submit = pb.SubmitRequest(
                        request_id=f"r{i}-{time.monotonic_ns()}",
                        prompt_token_ids=[
                            rng.randrange(3, 49152) for _ in range(self.args.prompt_len)
                        ],
                        sampling=sampling,
                        eos_token_id=-1,
                    )
                    await call.write(pb.FrontendMessage(submit=submit))
                self.submitted = True
                reader = asyncio.create_task(self._count(call))
                stopping = asyncio.create_task(self.stopping.wait())
                done, _ = await asyncio.wait(
                    {reader, stopping}, return_when=asyncio.FIRST_COMPLETED
                )
                if reader in done:
                    reader.result()  # the stream ended or failed before the stop: an error
                    raise ConnectionError("the leader ended the FrontendLink stream")
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
            finally:
                call.cancel()

    async def _await_workers(self, call, pb) -> None:
        """Reads the leader's status (once a second) until it lists every worker, for at most
        a minute: requests placed before all attach would crowd the first ones."""
        import grpc

        deadline = time.monotonic() + 60
        while self.workers_listed < self.args.workers and time.monotonic() < deadline:
            try:
                raw = await asyncio.wait_for(call.read(), max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                break
            if raw is grpc.aio.EOF:
                raise ConnectionError("the leader ended the stream before the requests")
            msg = pb.LeaderMessage.FromString(raw)
            if msg.WhichOneof("msg") == "status":
                self.workers_listed = len(msg.status.server_info.workers)
        if self.workers_listed < self.args.workers:
            print(
                f"the leader lists {self.workers_listed} of {self.args.workers} workers",
                flush=True,
            )

    async def _count(self, call) -> None:
        import grpc

        while True:
            raw = await call.read()
            if raw is grpc.aio.EOF:
                return
            self.messages += 1
            self.bytes += len(raw)


def scheduler_flags(args) -> list[str]:
    """The scheduling flags leader and shards share."""
    flags = [
        "--max-num-seqs",
        str(args.running),
        "--max-num-batched-tokens",
        str(args.budget),
        "--max-model-len",
        str(args.max_model_len),
        "--log-level",
        "warning",
    ]
    if args.model:
        flags += ["--model", args.model]
    return flags


def start_tier(num_shards: int, args, tmp: Path) -> tuple[Tier, list[Path], str]:
    tier = Tier(tmp, args.verbose)
    LIVE_TIERS.append(tier)
    worker_port, client_port = free_port(), free_port()
    leader = [
        *CLI,
        "scheduler",
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        "--http-port",
        str(free_port()),
        "--worker-port",
        str(worker_port),
        "--no-client-api",
        "--worker-queue-depth",
        str(args.running),
        *scheduler_flags(args),
        *shlex.split(args.leader_args),
    ]
    tier.spawn("leader", f"leader-s{num_shards}", leader)
    step_ports = []
    for i in range(num_shards):
        port = free_port()
        step_ports.append(port)
        shard = [
            *CLI,
            "shard",
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
            "--http-port",
            str(free_port()),
            "--leader",
            f"127.0.0.1:{worker_port}",
            "--worker-port",
            str(port),
            "--scheduler-id",
            f"shard-{i}",
            *scheduler_flags(args),
            *shlex.split(args.shard_args),
        ]
        tier.spawn("shard", f"shard-{i}-s{num_shards}", shard)
    for i in range(args.frontends if args.client == "grpc" else 0):
        frontend = [
            *CLI,
            "frontend",
            "--host",
            "127.0.0.1",
            "--port",
            str(client_port),
            "--http-port",
            "0",
            "--scheduler",
            f"127.0.0.1:{worker_port}",
            "--frontend-id",
            f"fe{i}",
            "--max-model-len",
            str(args.max_model_len),
            "--log-level",
            "warning",
            *(["--model", args.model] if args.model else []),
        ]
        tier.spawn("frontend", f"frontend-{i}-s{num_shards}", frontend)
    traces = []
    for i in range(args.workers):
        port = step_ports[i % num_shards] if num_shards else worker_port
        trace = tmp / f"worker-{i}-s{num_shards}.trace"
        traces.append(trace)
        worker = [
            sys.executable,
            str(Path(__file__).resolve()),
            "worker-trace",
            str(trace),
            "--scheduler",
            f"127.0.0.1:{port}",
            "--worker-id",
            f"w{i}",
            "--simulate",
            "--sim-step-base-ms",
            str(args.step_ms),
            "--sim-step-per-token-us",
            "0",
            "--sim-num-blocks",
            str(args.running * (args.max_model_len // 16 + 2)),
            "--max-model-len",
            str(args.max_model_len),
            "--log-level",
            "warning",
            *(["--model", args.model] if args.model else []),
        ]
        tier.spawn("worker", f"worker-{i}-s{num_shards}", worker)
    if args.client == "link":  # this process is the front-end: the leader's internal port
        return tier, traces, f"127.0.0.1:{worker_port}"
    return tier, traces, f"127.0.0.1:{client_port}"


def wait_until(tier: Tier, done, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        tier.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout:g} s (logs: {tier.tmp})")
        time.sleep(0.2)


def all_running(traces: list[Path], running: int) -> bool:
    """Every worker's latest step carried `running` rows that got a token."""
    for trace in traces:
        steps = read_trace(trace)
        if not steps or steps[-1][1] < running:
            return False
    return True


def run_point(num_shards: int, args, tmp: Path) -> dict:
    tier, traces, target = start_tier(num_shards, args, tmp)
    clients = None
    try:
        if args.client == "link":
            clients = LinkClients(target, args.workers * args.running, args)
            clients.start()
            wait_until(tier, lambda: clients.errors or clients.submitted, "no leader answered", 120)
        else:
            clients = start_grpc_clients(tier, target, args)

        def ready() -> bool:
            if clients.errors:
                raise RuntimeError(f"the clients' requests failed: {clients.errors[:3]}")
            return all_running(traces, args.running)

        wait_until(
            tier,
            ready,
            f"not every worker ran {args.running} requests",
            args.ready_timeout,
        )
        time.sleep(args.warmup)
        tier.check_alive()
        kinds = ("leader", "shard", "frontend", "worker")
        cpu0 = {c.name: cpu_seconds(c.proc.pid) for c in tier.children}
        own0, t0 = self_cpu_seconds(), time.monotonic()
        tokens0, messages0, bytes0 = clients.tokens, _messages(clients), _bytes(clients)
        time.sleep(args.seconds)
        cpu1 = {c.name: cpu_seconds(c.proc.pid) for c in tier.children}
        own1, t1 = self_cpu_seconds(), time.monotonic()
        tokens1, messages1, bytes1 = clients.tokens, _messages(clients), _bytes(clients)
        tier.check_alive()
        if clients.errors:
            raise RuntimeError(f"the clients' requests failed: {clients.errors[:3]}")
        time.sleep(2 * TRACE_FLUSH_S)  # the window's last steps reach the traces
        per_worker = []
        idles: list[float] = []
        for trace in traces:
            steps = [s for s in read_trace(trace) if t0 < s[0] <= t1]
            per_worker.append(sum(s[1] for s in steps))
            idles.extend(s[2] for s in steps)
        wall = t1 - t0
        request_steps = sum(per_worker)
        rs = max(request_steps, 1)
        cpu = {c.name: cpu1[c.name] - cpu0[c.name] for c in tier.children}
        by_kind = {k: sum(cpu[c.name] for c in tier.of(k)) for k in kinds}
        shard_rs = [  # each shard's own request-steps: those of its workers
            sum(n for j, n in enumerate(per_worker) if j % num_shards == i)
            for i in range(num_shards)
        ]
        leader_us = 1e6 * by_kind["leader"] / rs
        shards_us = 1e6 * by_kind["shard"] / rs
        return {
            "client": args.client,
            "frontends": args.frontends if args.client == "grpc" else 0,
            "shards": num_shards,
            "workers": args.workers,
            "running_per_worker": args.running,
            "step_ms": args.step_ms,
            "seconds": round(wall, 2),
            "request_steps_per_s": round(request_steps / wall, 1),
            # the ceiling: every worker stepping back to back at --step-ms
            "ideal_request_steps_per_s": round(args.workers * args.running / args.step_ms * 1e3),
            "client_tokens_per_s": (
                round((tokens1 - tokens0) / wall, 1) if clients.tokens_counted else None
            ),
            "steps": len(idles),
            "rows_per_step": round(request_steps / max(len(idles), 1), 1),
            # tokens that reached the clients per request-step (< 1: they lag behind the steps);
            # None with --client link, which does not parse the token batches
            "delivered": round((tokens1 - tokens0) / rs, 3) if clients.tokens_counted else None,
            # --client link: the LeaderMessages it received in the window (unparsed)
            "link_messages_per_s": (
                None if messages0 is None else round((messages1 - messages0) / wall, 1)
            ),
            "link_bytes_per_request_step": (
                None if bytes0 is None else round((bytes1 - bytes0) / rs, 2)
            ),
            "idle_ms_p50": _ms(percentile(idles, 0.50)),
            "idle_ms_p99": _ms(percentile(idles, 0.99)),
            "idle_ms_mean": _ms(sum(idles) / len(idles) if idles else None),
            "leader_us_per_request_step": round(leader_us, 2),
            "shards_us_per_request_step": round(shards_us, 2),
            "shard_us_per_own_request_step": [
                round(1e6 * cpu[c.name] / max(n, 1), 2)
                for c, n in zip(tier.of("shard"), shard_rs, strict=True)
            ],
            "leader_cpu_util": round(by_kind["leader"] / wall, 3),
            "shard_cpu_util": [round(cpu[c.name] / wall, 3) for c in tier.of("shard")],
            "frontend_us_per_request_step": round(1e6 * by_kind["frontend"] / rs, 2),
            "frontend_cpu_util": round(by_kind["frontend"] / wall, 3),
            "client_us_per_request_step": round(1e6 * (own1 - own0) / rs, 2),
            "client_cpu_util": round((own1 - own0) / wall, 3),
            "worker_us_per_request_step": round(1e6 * by_kind["worker"] / rs, 2),
            "worker_cpu_util": round(by_kind["worker"] / wall, 3),
            # every process of the point (tier, front-ends, workers, this one) in cores
            "cores_busy": round((sum(cpu.values()) + own1 - own0) / wall, 2),
            "cores": os.cpu_count(),
            "cores_for_64x256_at_10ms": round(
                TARGET_REQUEST_STEPS_PER_S * (leader_us + shards_us) / 1e6, 1
            ),
            "client_errors": clients.errors[:5],
        }
    finally:
        if clients is not None:
            clients.stop()
        tier.stop()
        LIVE_TIERS.remove(tier)


def _messages(clients) -> int | None:
    return getattr(clients, "messages", None)


def _bytes(clients) -> int | None:
    return getattr(clients, "bytes", None)


def start_grpc_clients(tier: Tier, target: str, args) -> Clients:
    """--client grpc: once the front-end lists the workers, the W x R client streams."""
    from common.client import SplitserveClient

    def attached() -> int:
        """Workers the front-end lists (placed before all attach, the requests crowd the
        first ones); -1 while it does not answer."""
        try:
            with SplitserveClient(target, timeout=2) as c:
                return len(c.server_info().workers)
        except Exception:  # noqa: BLE001 - not serving yet
            return -1

    wait_until(tier, lambda: attached() >= 0, "no front-end answered", 120)
    try:
        wait_until(tier, lambda: attached() >= args.workers, "workers missing", 60)
    except TimeoutError:  # a leader that lists no shards' workers: the traces tell
        print(f"the front-end lists {attached()} of {args.workers} workers", flush=True)
    clients = Clients(target, args.workers * args.running, args)
    clients.start()
    return clients


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1e3 * seconds, 3)


def show(rows: list[dict], args) -> None:
    from rich.console import Console
    from rich.table import Table

    link = args.client == "link"
    one = next((r for r in rows if r["shards"] == 1), None)
    clients = (
        "client: link (this process is the front-end, no front-end process)"
        if link
        else f"client: grpc (through {args.frontends} front-end process(es))"
    )
    table = Table(
        title=f"scheduler tier: {args.workers} simulated workers x {args.running} running, "
        f"{args.step_ms:g} ms steps, {clients}, {os.cpu_count()} cores"
    )
    columns = [
        "shards",
        "req-steps/s",
        "of ideal %",
        "rows/step",
        "link B/rs" if link else "delivered %",
        "speedup vs 1",
        "idle p50 ms",
        "idle p99 ms",
        "leader µs/rs",
        "shards µs/rs",
        *([] if link else ["front-end µs/rs"]),
        "client µs/rs",
        "workers µs/rs",
        "cores busy",
        "cores 64x256@10ms",
    ]
    for col in columns:
        table.add_column(col, justify="right")
    for r in rows:
        speedup = (
            f"{r['request_steps_per_s'] / one['request_steps_per_s']:.2f}"
            if one and one["request_steps_per_s"]
            else "-"
        )
        r["speedup_vs_1_shard"] = None if speedup == "-" else float(speedup)
        table.add_row(
            str(r["shards"]) if r["shards"] else "0 (single)",
            f"{r['request_steps_per_s']:.0f}",
            f"{100 * r['request_steps_per_s'] / r['ideal_request_steps_per_s']:.1f}",
            f"{r['rows_per_step']:.1f}",
            _fmt(r["link_bytes_per_request_step"], 1) if link else f"{100 * r['delivered']:.0f}",
            speedup,
            _fmt(r["idle_ms_p50"]),
            _fmt(r["idle_ms_p99"]),
            f"{r['leader_us_per_request_step']:.1f}",
            f"{r['shards_us_per_request_step']:.1f}",
            *([] if link else [f"{r['frontend_us_per_request_step']:.1f}"]),
            f"{r['client_us_per_request_step']:.1f}",
            f"{r['worker_us_per_request_step']:.1f}",
            f"{r['cores_busy']:.2f} of {r['cores']}",
            f"{r['cores_for_64x256_at_10ms']:.1f}",
        )
    Console(width=None if sys.stdout.isatty() else 230).print(table)


def _fmt(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def default_shards() -> list[int]:
    cores = os.cpu_count() or 1
    counts = [0, 1, 2]
    while counts[-1] * 2 <= cores:
        counts.append(counts[-1] * 2)
    return counts


def stop_all(*_exc) -> None:
    for tier in list(LIVE_TIERS):
        tier.stop()


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "worker-trace":
        worker_trace(sys.argv[2], sys.argv[3:])
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shards", type=int, nargs="+", default=default_shards(), help="0 = single process"
    )
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--running", type=int, default=256, help="running requests per worker")
    parser.add_argument("--step-ms", type=float, default=10.0, help="simulated step time")
    parser.add_argument("--seconds", type=float, default=15.0, help="measured window")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds once all run")
    parser.add_argument(
        "--client",
        choices=("link", "grpc"),
        default="link",
        help="link: this process speaks the FrontendLink to the leader (no front-end process);"
        " grpc: client streams through --frontends `splitserve frontend` processes",
    )
    parser.add_argument("--frontends", type=int, default=1, help="with --client grpc")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--budget", type=int, default=4096, help="max_num_batched_tokens")
    parser.add_argument("--max-model-len", type=int, default=8192, help="the requests' length")
    parser.add_argument("--model", default="", help="as `splitserve scheduler --model`")
    parser.add_argument("--leader-args", default="", help="more flags for the leader")
    parser.add_argument("--shard-args", default="", help="more flags for each shard")
    parser.add_argument(
        "--ready-timeout", type=float, default=180.0, help="for all requests to run"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--verbose", action="store_true", help="print each process's command")
    args = parser.parse_args()
    steps_needed = (args.warmup + args.seconds + 30) * 1e3 / args.step_ms  # 30 s: the ramp
    if args.client == "link" and steps_needed > args.max_model_len - args.prompt_len:
        print(  # nothing resubmits a request that ends: the rows would thin out
            f"warning: a request lasts {args.max_model_len - args.prompt_len} steps, a point "
            f"about {steps_needed:.0f}: raise --max-model-len",
            file=sys.stderr,
        )
    from tqdm import tqdm

    # the finally blocks stop the children, on Ctrl-C too (even where the shell ignores SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tmp = Path(tempfile.mkdtemp(prefix="scheduler-scale-"))
    if args.verbose:
        print(f"logs and traces: {tmp}", flush=True)
    rows = []
    try:
        for n in tqdm(args.shards, desc="shard counts"):
            rows.append(run_point(n, args, tmp))
            if args.verbose:
                print(json.dumps(rows[-1]), flush=True)
    except KeyboardInterrupt:
        print("interrupted: every child stopped", file=sys.stderr)
        return 130
    finally:
        stop_all()
    show(rows, args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
