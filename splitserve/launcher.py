"""`splitserve up`: schedulers, front-ends and workers as child processes (and a local etcd
for several schedulers), under a supervisor that restarts what dies and stops the group in
order (splitserve/supervisor.py)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from pathlib import Path

from common.credentials import create_cluster, default_state_dir
from common.etcd_server import free_port
from common.logging import configure_logging, get_logger
from common.settings import dataclass_from_args, to_argv
from splitserve.supervisor import ChildSpec, Supervisor, SupervisorConfig, spawn_process

WORKER_NICE = 5
CREDENTIALS_NOTE = (
    "every internal link is mutual TLS under this cluster's CA; give a worker or front-end on "
    "another host its role's directory (--credentials DIR/worker, DIR/frontend)"
)
log = get_logger("splitserve.up")


def child_specs(
    args: argparse.Namespace, cfg, etcd_data_dir: str = "", credentials: Path | None = None
) -> list[ChildSpec]:
    """etcd (with several schedulers and no --etcd), the schedulers, the front-ends, the
    workers, each with its role's directory of the cluster's `credentials` (mutual TLS on
    every internal link); secrets are not on these command lines. With front-ends apart, they
    own the public ports (--port, --http-port, shared through SO_REUSEPORT) and each scheduler
    gets its own: its HTTP port still serves /metrics and the dashboard."""
    from scheduler_svc.config import HttpLimits

    cli = [sys.executable, "-m", "splitserve.cli"]

    def role(name: str) -> list[str]:
        return ["--credentials", str(credentials / name)] if credentials is not None else []

    argv = to_argv(cfg)
    for flag in ("--api-key", "--etcd", "--scheduler-id", "--credentials"):
        k = argv.index(flag)
        del argv[k : k + 2]
    specs: list[ChildSpec] = []
    etcd = cfg.etcd
    if args.schedulers > 1 and not etcd:
        etcd = f"127.0.0.1:{args.etcd_port}"
        specs.append(
            ChildSpec(
                "etcd",
                [
                    sys.executable,
                    "-m",
                    "common.etcd_server",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(args.etcd_port),
                    "--data-dir",
                    etcd_data_dir,
                    *role("etcd"),
                    *(["--root-credentials", str(credentials / "root")] if credentials else []),
                ],
                kind="etcd",
            )
        )
    apart = args.frontends > 0
    worker_ports = [cfg.worker_port] + [free_port() for _ in range(args.schedulers - 1)]
    for i in range(args.schedulers):
        own = argv
        if apart:  # the front-ends serve the clients: this process only schedules
            own = [("--no-client-api" if a == "--client-api" else a) for a in own]
        if apart or i > 0:
            own = _replace(own, "--port", str(free_port()))
            if cfg.http_port:
                own = _replace(own, "--http-port", str(free_port()))
        own = _replace(own, "--worker-port", str(worker_ports[i]))
        own = [*own, *role("scheduler")]
        if etcd:
            own = [*own, "--etcd", etcd, "--scheduler-id", f"scheduler-{i}"]
        specs.append(
            ChildSpec(
                f"scheduler-{i}",
                [*cli, "scheduler", *own],
                critical=args.schedulers == 1,
                kind="scheduler",
            )
        )
    follow = ["--etcd", etcd] if etcd else ["--scheduler", f"127.0.0.1:{cfg.worker_port}"]
    shard_ports = [free_port() for _ in range(args.scheduler_shards)]
    for i, port in enumerate(shard_ports):
        own = [("--no-client-api" if a == "--client-api" else a) for a in argv]
        own = _replace(own, "--port", str(free_port()))
        own = _replace(own, "--http-port", "0")
        own = _replace(own, "--worker-port", str(port))
        leader = ["--etcd", etcd] if etcd else ["--leader", f"127.0.0.1:{cfg.worker_port}"]
        own = [*own, *leader, "--scheduler-id", f"shard-{i}", *role("scheduler")]
        specs.append(ChildSpec(f"shard-{i}", [*cli, "shard", *own], kind="shard"))
    for i in range(args.frontends):
        frontend_argv = [
            *cli,
            "frontend",
            "--host",
            cfg.host,
            "--port",
            str(cfg.port),
            "--http-port",
            str(cfg.http_port),
            "--frontend-id",
            f"frontend-{i}",
            "--max-model-len",
            str(cfg.max_model_len),
            *to_argv(cfg, HttpLimits),
            "--log-level",
            cfg.log_level,
            "--log-json" if cfg.log_json else "--no-log-json",
            *follow,
            *role("frontend"),
        ]
        if cfg.model:
            frontend_argv += ["--model", cfg.model]
        specs.append(ChildSpec(f"frontend-{i}", frontend_argv, kind="frontend"))
    threads = max(1, (os.cpu_count() or 1) // max(1, args.workers))
    for i in range(args.workers):
        # with step shards, each worker dials its shard (round robin), then the others when
        # that one is lost (taking the rows it holds along)
        dial = follow
        if shard_ports:
            k = i % len(shard_ports)
            order = shard_ports[k:] + shard_ports[:k]
            dial = ["--scheduler", ",".join(f"127.0.0.1:{p}" for p in order)]
        worker_argv = [
            *cli,
            "worker",
            *dial,
            *role("worker"),
            "--worker-id",  # a restarted worker keeps it: dashboards and metrics stay readable
            f"worker-{i}",
            "--num-threads",
            str(threads),
            "--log-level",
            cfg.log_level,
            "--log-json" if cfg.log_json else "--no-log-json",
            *args.worker_arg,
        ]
        if cfg.model:
            worker_argv += ["--model", cfg.model]
        specs.append(ChildSpec(f"worker-{i}", worker_argv))
    return specs


def default_shards(asked: int, num_workers: int, cores: int | None = None) -> int:
    """--scheduler-shards: as asked, or (-1) one per 8 workers, at most one per 2 cores beyond
    the leader's and the front-end's: a shard pays only where a scheduler process is full."""
    if asked >= 0:
        return asked
    cores = cores or os.cpu_count() or 1
    return max(0, min(num_workers // 8, (cores - 2) // 2))


def _replace(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    out[out.index(flag) + 1] = value
    return out


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
    env = dict(os.environ, SPLITSERVE_API_KEY=cfg.api_key)
    env.pop("SPLITSERVE_CREDENTIALS", None)  # each child gets its role's on its command line
    state_dir = Path(args.state_dir).expanduser() if args.state_dir else default_state_dir()
    credentials = create_cluster(state_dir / "credentials")
    # said at every log level: the one place a user learns where the cluster's keys are
    print(f"splitserve up: the cluster's credentials are in {credentials}", file=sys.stderr)
    log.info("credentials", directory=str(credentials), message=CREDENTIALS_NOTE)
    if args.schedulers < 1 or args.frontends < 0 or args.workers < 0:
        raise SystemExit("--schedulers must be 1 or more, --frontends and --workers 0 or more")
    args.scheduler_shards = default_shards(args.scheduler_shards, args.workers)
    if (args.schedulers > 1 or args.scheduler_shards) and args.frontends == 0:
        # clients must not hang on a scheduler process that can die; a leader's shards pass
        # their tokens to front-ends apart
        args.frontends = 1
    etcd_dir = tempfile.mkdtemp(prefix="splitserve-etcd-")
    specs = child_specs(args, cfg, etcd_dir, credentials)
    # the control plane (etcd, schedulers, front-ends) before the compute: on a machine the
    # workers saturate, a starved scheduler would miss its lease keepalives and hand over
    niced = {tuple(spec.argv) for spec in specs if spec.role == "worker"}
    supervisor = Supervisor(
        sup_cfg,
        specs,
        lambda argv: spawn_process(argv, env, WORKER_NICE if tuple(argv) in niced else 0),
    )
    # caught before the first child starts: the children then start with them at their
    # default even where `up` was started with SIGINT ignored (a background job of a script)
    with supervisor.catch_stop_signals():
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
