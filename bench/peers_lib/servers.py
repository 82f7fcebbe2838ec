"""Systems behind a socket: splitserve over gRPC (scheduler + one worker process) and llama.cpp's
`llama-server`. Both are driven by the same asyncio client, one streaming call per request, sent
at its arrival time; token arrival times come from the stream."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from common import event_loop
from peers_lib.workload import Workload
from splitserve.loadgen import GrpcBackend, RequestResult
from splitserve.loadgen.results import _Timer

ROOT = Path(__file__).resolve().parents[2]


async def drive(backend, wl: Workload, offsets: list[float], desc: str):
    """Send request i at offsets[i] seconds; returns (results, seconds to the last completion)."""
    from splitserve.loadgen import BenchRequest

    bar = tqdm(total=wl.num_requests * wl.max_tokens, desc=desc, unit="tok", leave=False)
    t0 = time.perf_counter()

    async def one(i: int, prompt: list[int]) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
        res = await backend.send(BenchRequest(prompt, wl.max_tokens), t0)
        bar.update(res.output_len)
        return res

    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(wl.prompts)))
    duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration


async def warm_up(backend, prompt: list[int]) -> None:
    from splitserve.loadgen import BenchRequest

    res = await backend.send(BenchRequest(prompt, 4), time.perf_counter())
    if not res.ok:
        raise RuntimeError(f"warm-up request failed: {res.error}")


def run_runs(backend_factory, wl: Workload, runs: list[tuple[str, list[float]]], name: str):
    """Each (arrival mode, offsets) through one backend: {mode: (results, duration)}."""

    async def main():
        backend = backend_factory()
        try:
            await warm_up(backend, wl.prompts[0][:32])
            out = {}
            for mode, offsets in runs:
                out[mode] = await drive(backend, wl, offsets, f"{name} {mode}")
            return out
        finally:
            await backend.close()

    return event_loop.run(main())


# ---- processes ------------------------------------------------------------------------------
class Process:
    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict | None = None):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.popen = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
            stdout=open(self.log_path, "wb"),  # noqa: SIM115 - the child owns it
            stderr=subprocess.STDOUT,
        )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def stop(self, timeout: float = 15.0) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check, proc: Process, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited early:\n{proc.log_tail()}")
        try:
            if check():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{proc.name}: {what} not within {timeout:.0f} s:\n{proc.log_tail()}")


# ---- splitserve over gRPC -------------------------------------------------------------------
def run_splitserve_grpc(args, wl: Workload, runs, log_dir: Path) -> dict:
    """`splitserve scheduler` + one `splitserve worker`, as the e2e tests start them."""
    import grpc

    from common.pb import generation_pb2 as pb
    from common.pb import generation_pb2_grpc

    port, wport = free_port(), free_port()
    cli = [os.environ.get("PYTHON", str(ROOT / ".venv/bin/python")), "-m", "splitserve.cli"]
    if not Path(cli[0]).exists():
        import sys

        cli[0] = sys.executable
    sched = Process(
        "splitserve-scheduler",
        cli
        + [
            "scheduler",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-port",
            str(wport),
            "--http-port",
            "0",
            "--max-num-batched-tokens",
            str(args.max_num_batched_tokens),
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--no-enable-prefix-caching",
            "--log-level",
            "WARNING",
        ],
        log_dir,
    )
    procs = [sched]
    try:
        worker = Process(
            "splitserve-worker",
            cli
            + [
                "worker",
                "--scheduler",
                f"127.0.0.1:{wport}",
                "--worker-id",
                "peers-w0",
                "--num-threads",
                str(args.threads),
                "--dtype",
                args.dtype,
                "--quantization",
                args.quantization,
                "--kv-cache-memory",
                str(int(args.kv_cache_gib * (1 << 30))),
                "--log-level",
                "WARNING",
            ],
            log_dir,
        )
        procs.append(worker)

        def attached() -> bool:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                return bool(stub.GetServerInfo(pb.ServerInfoRequest(), timeout=5).workers)

        wait_until(attached, worker, 600, "the worker attached")
        ns = argparse.Namespace(
            target=f"127.0.0.1:{port}",
            api_key=None,
            model=None,
            temperature=0.0,
            ignore_eos=True,
            timeout=3600.0,
        )
        return run_runs(lambda: GrpcBackend(ns), wl, runs, "splitserve-grpc")
    finally:
        for p in reversed(procs):
            p.stop()


# ---- llama.cpp's llama-server ----------------------------------------------------------------
def find_llama_server(explicit: str | None) -> Path | None:
    if explicit:
        return Path(explicit)
    cache = Path(os.environ.get("SPLITSERVE_CACHE_DIR", Path.home() / ".cache/splitserve"))
    base = Path(os.environ.get("LLAMA_CPP_DIR", cache / "llama.cpp"))
    for cand in (base / "build/bin/llama-server", shutil.which("llama-server")):
        if cand and Path(cand).is_file():
            return Path(cand)
    return None


class LlamaBackend:
    """llama-server's native /completion: token-id prompt, greedy, EOS ignored, no prompt cache,
    streamed (one SSE event per token)."""

    def __init__(self, base_url: str) -> None:
        import httpx

        self.client = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(3600.0, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )

    async def send(self, req, t0: float) -> RequestResult:
        import httpx

        result = RequestResult(prompt_len=len(req.prompt_token_ids))
        payload = {
            "prompt": req.prompt_token_ids,
            "n_predict": req.max_tokens,
            "ignore_eos": True,
            "cache_prompt": False,
            "temperature": 0.0,
            "top_k": 1,
            "stream": True,
            "return_tokens": True,
        }
        timer = _Timer(result, t0)
        count = 0
        try:
            async with self.client.stream("POST", "/completion", json=payload) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    result.error = f"HTTP {resp.status_code}: {body[:300]}"
                    return result
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    chunk = json.loads(line[5:].strip())
                    if "error" in chunk:
                        result.error = str(chunk["error"])
                        break
                    n = len(chunk.get("tokens") or ()) or (0 if chunk.get("stop") else 1)
                    if n:
                        timer.tokens(n)
                        count += n
                    if chunk.get("stop"):
                        result.output_len = int(chunk.get("tokens_predicted") or count)
                        result.ok = True
                        break
            timer.done()
            if not result.ok and not result.error:
                result.error = "the stream ended without stop"
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        return result

    async def close(self) -> None:
        await self.client.aclose()


def llama_server_argv(binary: Path, gguf: Path, args, wl: Workload, port: int) -> list[str]:
    per_slot = -(-(max(wl.prompt_lens) + wl.max_tokens + 16) // 256) * 256
    return [
        str(binary),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(args.llama_slots),
        "-cb",
        "-c",
        str(per_slot * args.llama_slots),
        "-t",
        str(args.threads),
        "-tb",
        str(args.threads),
        "--cache-ram",
        "0",
        *shlex.split(args.llama_args or ""),
    ]


def run_llama_server(args, wl: Workload, runs, log_dir: Path, binary: Path) -> dict:
    import httpx

    from common.model_source import default_model_path

    gguf = Path(args.gguf) if args.gguf else default_model_path()
    port = free_port()
    proc = Process("llama-server", llama_server_argv(binary, gguf, args, wl, port), log_dir)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(
            lambda: httpx.get(f"{base}/health", timeout=2).status_code == 200, proc, 300, "/health"
        )
        return run_runs(lambda: LlamaBackend(base), wl, runs, "llama-server")
    finally:
        proc.stop()


def log_dir_for(args) -> Path:
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        return Path(args.log_dir)
    return Path(tempfile.mkdtemp(prefix="splitserve-peers-"))
