"""`splitserve up`: a scheduler and N workers as child processes, stopped together."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from common.settings import dataclass_from_args, to_argv


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "splitserve.cli", *args], env=env)


def run_up(args: argparse.Namespace) -> int:
    from scheduler_svc.config import SchedulerServiceConfig

    cfg = dataclass_from_args(SchedulerServiceConfig, args)
    # secrets travel in the children's environment, not on their command lines (ps shows those)
    env = dict(
        os.environ, SPLITSERVE_API_KEY=cfg.api_key, SPLITSERVE_WORKER_SECRET=cfg.worker_secret
    )
    argv = to_argv(cfg)
    for flag in ("--api-key", "--worker-secret"):
        k = argv.index(flag)
        del argv[k : k + 2]
    procs: list[subprocess.Popen] = [_spawn(["scheduler", *argv], env)]
    threads = max(1, (os.cpu_count() or 1) // max(1, args.workers))
    scheduler_addr = f"127.0.0.1:{cfg.worker_port}"
    for i in range(args.workers):
        worker_argv = [
            "worker",
            "--scheduler",
            scheduler_addr,
            "--worker-id",
            f"worker-{i}",
            "--num-threads",
            str(threads),
            *args.worker_arg,
        ]
        if cfg.model:
            worker_argv += ["--model", cfg.model]
        procs.append(_spawn(worker_argv, env))

    stopping = False

    def stop(signum=None, frame=None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    if args.demo:
        _demo(f"127.0.0.1:{cfg.port}", args.demo, lambda: stopping)
    while not stopping and all(p.poll() is None for p in procs):
        time.sleep(0.2)
    code = 0
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
        elif p.returncode not in (0, -signal.SIGINT):
            code = 1
    deadline = time.monotonic() + 15
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return code


def _demo(target: str, prompt: str, stopped) -> None:
    import grpc

    from common.client import SplitserveClient

    with SplitserveClient(target) as client:
        while not stopped():
            try:
                client.wait_for_workers(1, timeout=1.0)
                break
            except TimeoutError:
                continue
        if stopped():
            return
        print(f"\n>>> {prompt}", flush=True)
        try:
            for msg in client.stream(
                messages=[{"role": "user", "content": prompt}], max_tokens=64, temperature=0.0
            ):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}")
        print(
            f"\n\nsplitserve is up: gRPC on {target}. Try:\n"
            f'  .venv/bin/splitserve generate --chat "What is a KV cache?"\n'
            "Ctrl-C stops it.",
            flush=True,
        )
