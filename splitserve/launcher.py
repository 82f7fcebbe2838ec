"""`splitserve up`: a scheduler and N workers as child processes, under a supervisor that
restarts a worker that dies and stops the group in order (splitserve/supervisor.py)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from common.logging import configure_logging
from common.settings import dataclass_from_args, to_argv
from splitserve.supervisor import ChildSpec, Supervisor, SupervisorConfig, spawn_process


def child_specs(args: argparse.Namespace, cfg) -> list[ChildSpec]:
    """The scheduler first, then the workers; secrets are not on these command lines."""
    cli = [sys.executable, "-m", "splitserve.cli"]
    argv = to_argv(cfg)
    for flag in ("--api-key", "--worker-secret"):
        k = argv.index(flag)
        del argv[k : k + 2]
    specs = [ChildSpec("scheduler", [*cli, "scheduler", *argv], critical=True)]
    threads = max(1, (os.cpu_count() or 1) // max(1, args.workers))
    for i in range(args.workers):
        worker_argv = [
            *cli,
            "worker",
            "--scheduler",
            f"127.0.0.1:{cfg.worker_port}",
            "--worker-id",  # a restarted worker keeps it: dashboards and metrics stay readable
            f"worker-{i}",
            "--num-threads",
            str(threads),
            *args.worker_arg,
        ]
        if cfg.model:
            worker_argv += ["--model", cfg.model]
        specs.append(ChildSpec(f"worker-{i}", worker_argv))
    return specs


def check_supervisor_config(cfg: SupervisorConfig) -> None:
    if cfg.max_restarts < 0:
        raise SystemExit(
            f"--max-restarts must be 0 (never restart) or more; got {cfg.max_restarts}"
        )
    if cfg.restart_window <= 0 or cfg.restart_backoff < 0 or cfg.stop_timeout < 0:
        raise SystemExit(
            "--restart-window must be positive, --restart-backoff and --stop-timeout 0 or more"
        )


def run_up(args: argparse.Namespace) -> int:
    from scheduler_svc.config import SchedulerServiceConfig

    cfg = dataclass_from_args(SchedulerServiceConfig, args)
    sup_cfg = dataclass_from_args(SupervisorConfig, args)
    check_supervisor_config(sup_cfg)
    configure_logging(cfg.log_level, cfg.log_json)
    # secrets travel in the children's environment, not on their command lines (ps shows those)
    env = dict(
        os.environ, SPLITSERVE_API_KEY=cfg.api_key, SPLITSERVE_WORKER_SECRET=cfg.worker_secret
    )
    supervisor = Supervisor(sup_cfg, child_specs(args, cfg), lambda argv: spawn_process(argv, env))
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, supervisor.request_stop)
    if args.demo:
        target = f"127.0.0.1:{cfg.port}"
        stopped = lambda: supervisor.stopping  # noqa: E731
        threading.Thread(target=_demo, args=(target, args.demo, stopped), daemon=True).start()
    return supervisor.run()


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
