"""The `splitserve` command: scheduler, shard, worker, frontend, up, status, generate, credentials,
bench serve, sim."""

from __future__ import annotations

import argparse
import json
import sys

from common.settings import add_dataclass_args, dataclass_from_args


def _scheduler_parser(sub) -> None:
    from scheduler_svc.config import SchedulerServiceConfig

    p = sub.add_parser("scheduler", help="run the scheduler service")
    add_dataclass_args(p, SchedulerServiceConfig)


def _shard_parser(sub) -> None:
    from scheduler_svc.config import SchedulerServiceConfig

    p = sub.add_parser(
        "shard",
        help="run a step shard: the step loops of the workers that dial it, for the leader",
    )
    add_dataclass_args(p, SchedulerServiceConfig)


def _frontend_parser(sub) -> None:
    from frontend_svc.config import FrontendConfig

    p = sub.add_parser(
        "frontend", help="run the client APIs (HTTP, gRPC) in front of the leader scheduler"
    )
    add_dataclass_args(p, FrontendConfig)


def _status_parser(sub) -> None:
    from splitserve.status import add_arguments

    p = sub.add_parser("status", help="schedulers, front-ends and workers (GET /cluster)")
    add_arguments(p)


def _worker_parser(sub) -> None:
    from worker_svc.config import ModelRunnerConfig
    from worker_svc.link import WorkerLinkConfig
    from worker_svc.sim_runner import SimConfig

    p = sub.add_parser("worker", help="run a model worker that dials the scheduler")
    add_dataclass_args(p, WorkerLinkConfig)
    add_dataclass_args(p, ModelRunnerConfig)
    add_dataclass_args(p, SimConfig, heading="simulation")
    p.add_argument(
        "--print-capabilities",
        action="store_true",
        help="print the CPU level and the kernel each op runs with here, then exit",
    )


def _up_parser(sub) -> None:
    from scheduler_svc.config import SchedulerServiceConfig
    from splitserve.supervisor import SupervisorConfig

    p = sub.add_parser(
        "up", help="start a scheduler and N workers on this machine, restart a worker that dies"
    )
    own = p.add_argument_group("processes")
    own.add_argument("--workers", type=int, default=1, help="number of workers")
    own.add_argument(
        "--schedulers",
        type=int,
        default=1,
        help="schedulers: one leads, the others stand by (2 or more start a local etcd "
        "unless --etcd names one, and at least one front-end)",
    )
    own.add_argument(
        "--frontends",
        type=int,
        default=0,
        help="front-end processes sharing --port and --http-port (0 = the scheduler serves "
        "clients itself)",
    )
    own.add_argument(
        "--scheduler-shards",
        type=int,
        default=-1,
        help="step shards: processes that run the step loops of the workers, each for its "
        "share of them, for the leader (needs a front-end apart; -1 = one per 8 workers, at "
        "most one per 2 cores beyond the first 2, 0 = none)",
    )
    own.add_argument("--etcd-port", type=int, default=2379, help="port of the local etcd")
    own.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="extra flag for every worker, e.g. --worker-arg=--num-gpu-blocks=512",
    )
    own.add_argument(
        "--demo",
        default=None,
        metavar="PROMPT",
        help="once a worker is attached, send PROMPT and print the answer",
    )
    own.add_argument(
        "--state-dir",
        default=None,
        help="where `up` keeps the cluster's credentials (made on first start, mode 0600) "
        "[env SPLITSERVE_STATE_DIR; default $XDG_STATE_HOME/splitserve, "
        "~/.local/state/splitserve]",
    )
    add_dataclass_args(p, SupervisorConfig, heading="supervisor")
    add_dataclass_args(p, SchedulerServiceConfig, skip=("credentials",))


def _bench_parser(sub) -> None:
    from splitserve.loadgen import add_arguments

    p = sub.add_parser("bench", help="benchmarks against a running server")
    bench = p.add_subparsers(dest="bench_command", required=True)
    serve = bench.add_parser(
        "serve", help="load a server (splitserve gRPC or OpenAI HTTP) and report latency"
    )
    add_arguments(serve)


def _sim_parser(sub) -> None:
    from splitserve.sim.cli import add_arguments

    p = sub.add_parser("sim", help="the scheduler core against cost-model workers, simulated time")
    add_arguments(p)


def _credentials_parser(sub) -> None:
    p = sub.add_parser(
        "credentials",
        help="make a cluster's credentials: a CA and a certificate per role (mutual TLS)",
        description="Writes DIR/ca (the CA: keep it to yourself) and DIR/scheduler, "
        "DIR/worker, DIR/frontend, DIR/etcd, DIR/root, each with ca.crt, tls.crt and tls.key "
        "(mode 0600). Give each process its role's directory with --credentials. Kept when "
        "present and valid for 30 more days; run again to renew.",
    )
    p.add_argument("directory")
    p.add_argument(
        "--kubernetes-secrets",
        metavar="FILE",
        default="",
        help="also write each role's directory as a kubernetes.io/tls Secret "
        "splitserve-<role>-tls (keys ca.crt, tls.crt, tls.key; not the CA's key) into FILE, "
        "mode 0600, for `kubectl apply -f FILE` (docs/kubernetes.md)",
    )
    p.add_argument(
        "--namespace", default="splitserve", help="namespace of those Secrets [splitserve]"
    )


def run_credentials(args: argparse.Namespace) -> int:
    from common.credentials import ROLES, create_cluster

    root = create_cluster(args.directory)
    for role in ROLES:
        print(f"{role:10} {root / role}")
    if args.kubernetes_secrets:
        from splitserve.k8s_secrets import write_secrets

        try:
            path = write_secrets(root, args.kubernetes_secrets, args.namespace)
        except ValueError as exc:
            raise SystemExit(f"--namespace: {exc}") from exc
        print(f"{'secrets':10} {path}  (kubectl apply -f {path})")
    return 0


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="send one prompt and stream the answer")
    p.add_argument("prompt")
    p.add_argument("--scheduler", default="localhost:50051", help="scheduler's client address")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--tls-ca-file", default=None, help="CA of the scheduler's TLS certificate")
    p.add_argument("--tls-cert-file", default=None, help="client certificate (mutual TLS)")
    p.add_argument("--tls-key-file", default=None, help="client key (mutual TLS)")
    p.add_argument("--timeout", type=float, default=None)


def run_generate(args: argparse.Namespace) -> int:
    import grpc

    from common.client import FINISH_NAMES, SplitserveClient, build_request

    kwargs = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos or None,
        priority=args.priority,
    )
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
        prompt = None
    else:
        prompt = args.prompt
    build_request(prompt, **kwargs)  # argument errors before connecting
    with SplitserveClient(
        args.scheduler,
        api_key=args.api_key,
        timeout=args.timeout,
        tls_ca_file=args.tls_ca_file,
        tls_cert_file=args.tls_cert_file,
        tls_key_file=args.tls_key_file,
    ) as client:
        try:
            if args.json:
                result = client.generate(prompt, **kwargs)
                print(json.dumps(result.to_dict(), ensure_ascii=False))
                return 0 if result.finish_reason != "error" else 1
            finish = None
            for msg in client.stream(prompt, **kwargs):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.finish_reason:
                    finish = FINISH_NAMES[msg.finish_reason]
            sys.stdout.write("\n")
            print(f"[finish_reason: {finish}]", file=sys.stderr)
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _scheduler_parser(sub)
    _shard_parser(sub)
    _frontend_parser(sub)
    _status_parser(sub)
    _up_parser(sub)
    _generate_parser(sub)
    _credentials_parser(sub)
    _bench_parser(sub)
    _sim_parser(sub)
    needs_worker = (argv if argv is not None else sys.argv[1:])[:1] == ["worker"]
    if needs_worker:  # importing the worker's config pulls in nothing heavy, but keep it lazy
        _worker_parser(sub)
    else:
        sub.add_parser("worker", help="run a model worker that dials the scheduler")
    args = parser.parse_args(argv)
    if args.command == "scheduler":
        from scheduler_svc.config import SchedulerServiceConfig
        from splitserve.scheduler_process import main as scheduler_main

        scheduler_main(dataclass_from_args(SchedulerServiceConfig, args))
        return 0
    if args.command == "shard":
        from scheduler_svc.config import SchedulerServiceConfig
        from splitserve.shard_process import main as shard_main

        shard_main(dataclass_from_args(SchedulerServiceConfig, args))
        return 0
    if args.command == "status":
        from splitserve.status import run as run_status

        return run_status(args)
    if args.command == "frontend":
        from splitserve.frontend import FrontendConfig
        from splitserve.frontend import main as frontend_main

        frontend_main(dataclass_from_args(FrontendConfig, args))
        return 0
    if args.command == "worker" and args.print_capabilities:
        from worker_svc.kernel_report import print_capabilities

        print_capabilities()
        return 0
    if args.command == "worker":
        from worker_svc.config import ModelRunnerConfig
        from worker_svc.link import WorkerLinkConfig
        from worker_svc.main import main as worker_main
        from worker_svc.sim_runner import SimConfig

        return worker_main(
            dataclass_from_args(WorkerLinkConfig, args),
            dataclass_from_args(ModelRunnerConfig, args),
            dataclass_from_args(SimConfig, args),
        )
    if args.command == "up":
        from splitserve.launcher import run_up

        return run_up(args)
    if args.command == "generate":
        return run_generate(args)
    if args.command == "credentials":
        return run_credentials(args)
    if args.command == "bench":
        from splitserve.loadgen import run as bench_serve

        return bench_serve(args)
    if args.command == "sim":
        from splitserve.sim.cli import run as run_sim

        return run_sim(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
