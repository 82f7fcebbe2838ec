#!/usr/bin/env python3
"""Container health probe for every splitserve service (installed as `splitserve-health`).

    splitserve-health [--target localhost:50051] [--service NAME] [--timeout 3]
    splitserve-health --http http://127.0.0.1:2381/health [--expect '"health":"true"']
    splitserve-health --etcd-leader etcd:2379 [--no-stopped-process]
    ... [--credentials DIR]

Default: ask a gRPC server's standard `grpc.health.v1.Health/Check` (front-ends on their client
port, schedulers on their worker-link port). --http: GET a URL, healthy on a 2xx answer that
contains --expect (etcd's /health, served in plain HTTP on loopback). --etcd-leader: read the
leader scheduler's address from etcd's leader key (gRPC) and ask grpc.health.v1 there (a worker
has no port of its own: it is healthy while the leader it follows answers it).
--no-stopped-process: also fail while a process of this container is stopped (SIGSTOP, a
debugger), which no probe of a port notices. --credentials DIR: the container's role directory
(ca.crt, tls.crt, tls.key of `splitserve credentials`): every gRPC call is mutual TLS, a
scheduler must show the certificate naming splitserve-scheduler and etcd the one naming
splitserve-etcd; etcd lets a worker's or front-end's certificate read the leader key.

Exit 0 when healthy, 1 otherwise (with the reason on stderr). Needs only the standard library,
grpcio, grpcio-health-checking and aetcd's generated etcd protos (in both images); no probe
binary to download.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request

LEADER_KEY = "/splitserve/leader"  # common/coordination.py: /{cluster}/leader
# the names in the certificates (common/credentials.py): this script imports nothing of splitserve
SCHEDULER_NAME = "splitserve-scheduler"
ETCD_NAME = "splitserve-etcd"


def _channel(target: str, credentials: str, server_name: str):
    """Plaintext without `credentials`; else mutual TLS with that role directory's files,
    trusting only a certificate that names `server_name`."""
    import grpc

    if not credentials:
        return grpc.insecure_channel(target)
    files = {}
    for name in ("ca.crt", "tls.crt", "tls.key"):
        with open(os.path.join(credentials, name), "rb") as f:
            files[name] = f.read()
    creds = grpc.ssl_channel_credentials(
        root_certificates=files["ca.crt"],
        private_key=files["tls.key"],
        certificate_chain=files["tls.crt"],
    )
    options = [("grpc.ssl_target_name_override", server_name)]
    return grpc.secure_channel(target, creds, options=options)


def check_grpc(
    target: str, service: str = "", timeout: float = 3.0, credentials: str = ""
) -> tuple[bool, str]:
    """credentials: a role directory for mutual TLS with a scheduler; empty for plaintext."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with _channel(target, credentials, SCHEDULER_NAME) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as exc:
        return False, f"{exc.code().name}: {exc.details()}"
    except OSError as exc:  # a certificate file that is not there (yet)
        return False, str(exc)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def check_http(url: str, expect: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            body = reply.read(4096).decode(errors="replace")
            code = reply.status
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}"
    except (OSError, urllib.error.URLError) as exc:
        return False, str(getattr(exc, "reason", exc))
    if expect and expect not in body:
        return False, f"HTTP {code}, no {expect!r} in {body[:200]!r}"
    return 200 <= code < 300, f"HTTP {code} {body.strip()[:120]}"


def etcd_leader_address(
    endpoint: str, timeout: float = 3.0, credentials: str = ""
) -> tuple[str | None, str]:
    """The leader's worker-link address from etcd's leader key; (None, why) when none. Over
    gRPC, not etcd's JSON gateway: the gateway does not take a certificate as the etcd user."""
    import grpc
    from aetcd.rpc import rpc_pb2, rpc_pb2_grpc

    try:
        with _channel(endpoint, credentials, ETCD_NAME) as channel:
            request = rpc_pb2.RangeRequest(key=LEADER_KEY.encode())
            reply = rpc_pb2_grpc.KVStub(channel).Range(request, timeout=timeout)
    except grpc.RpcError as exc:
        return None, f"etcd {endpoint}: {exc.code().name}: {exc.details()}"
    except OSError as exc:
        return None, f"etcd {endpoint}: {exc}"
    if not reply.kvs:
        return None, f"etcd {endpoint}: no leader scheduler"
    try:
        value = json.loads(reply.kvs[0].value)
        return value["info"]["worker_address"], f"leader {value.get('member_id', '?')}"
    except (KeyError, ValueError, TypeError) as exc:
        return None, f"etcd {endpoint}: unreadable leader key ({exc})"


def stopped_process() -> str | None:
    """A process of this container (this PID namespace) that is stopped, or None."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state in ("T", "t"):
            return pid
    return None


def main(argv: list[str] | None = None) -> int:
    port = os.environ.get("SPLITSERVE_PORT", "50051")
    parser = argparse.ArgumentParser(prog="splitserve-health", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=f"localhost:{port}", help="HOST:PORT to probe")
    parser.add_argument("--service", default="", help="service name; empty = the whole server")
    parser.add_argument("--http", default="", metavar="URL", help="GET this URL instead")
    parser.add_argument("--expect", default="", help="with --http: text the answer must contain")
    parser.add_argument(
        "--etcd-leader",
        default="",
        metavar="HOST:PORT",
        help="probe the leader scheduler named in this etcd (service splitserve.v1.WorkerLink)",
    )
    parser.add_argument(
        "--no-stopped-process",
        action="store_true",
        help="also fail while a process in this container is stopped",
    )
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    parser.add_argument(
        "--credentials",
        default="",
        metavar="DIR",
        help="this container's role directory (ca.crt, tls.crt, tls.key): gRPC to schedulers "
        "and etcd over mutual TLS (without: plaintext, e.g. a front-end's client port)",
    )
    args = parser.parse_args(argv)

    if args.no_stopped_process:
        pid = stopped_process()
        if pid is not None:
            print(f"process {pid} is stopped", file=sys.stderr)
            return 1
    if args.http:
        what = args.http
        ok, status = check_http(args.http, args.expect, args.timeout)
    elif args.etcd_leader:
        address, why = etcd_leader_address(args.etcd_leader, args.timeout, args.credentials)
        if address is None:
            print(why, file=sys.stderr)
            return 1
        service = args.service or "splitserve.v1.WorkerLink"
        what = f"{why} at {address} {service}"
        ok, status = check_grpc(address, service, args.timeout, args.credentials)
    else:
        what = f"{args.target} {args.service or '(server)'}"
        ok, status = check_grpc(args.target, args.service, args.timeout, args.credentials)
    print(f"{what}: {status}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
