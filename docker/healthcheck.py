#!/usr/bin/env python3
"""Container health probe for every splitserve service (installed as `splitserve-health`).

    splitserve-health [--target localhost:50051] [--service NAME] [--timeout 3]
    splitserve-health --http http://localhost:2379/health [--expect '"health":"true"']
    splitserve-health --etcd-leader etcd:2379 [--no-stopped-process]
    ... [--tls-ca-file CA [--tls-cert-file C --tls-key-file K] [--tls-server-name NAME]]

Default: ask a gRPC server's standard `grpc.health.v1.Health/Check` (front-ends on their client
port, schedulers on their worker-link port). --http: GET a URL, healthy on a 2xx answer that
contains --expect (etcd's /health). --etcd-leader: read the leader scheduler's address from
etcd's JSON gateway and ask grpc.health.v1 there (a worker has no port of its own: it is healthy
while the leader it follows answers it). --no-stopped-process: also fail while a process of this
container is stopped (SIGSTOP, a debugger), which no probe of a port notices. --tls-ca-file
(or --tls): ask over TLS, mutual with --tls-cert-file and --tls-key-file, checking the server's
certificate for --tls-server-name (a worker-link port on `--worker-tls-*`).

Exit 0 when healthy, 1 otherwise (with the reason on stderr). Needs only the standard library,
grpcio and grpcio-health-checking (in both images); no probe binary to download.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import urllib.error
import urllib.request

LEADER_KEY = "/splitserve/leader"  # common/coordination.py: /{cluster}/leader


def _channel(target: str, tls: dict | None):
    import grpc

    if not tls:
        return grpc.insecure_channel(target)

    def read(path: str) -> bytes | None:
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()

    creds = grpc.ssl_channel_credentials(
        root_certificates=read(tls.get("ca_file", "")),
        private_key=read(tls.get("key_file", "")),
        certificate_chain=read(tls.get("cert_file", "")),
    )
    name = tls.get("server_name", "")
    options = [("grpc.ssl_target_name_override", name)] if name else []
    return grpc.secure_channel(target, creds, options=options)


def check_grpc(
    target: str, service: str = "", timeout: float = 3.0, tls: dict | None = None
) -> tuple[bool, str]:
    """tls: None for plaintext, else {ca_file, cert_file, key_file, server_name} (any may be
    empty: system roots, no client certificate, the target's own name)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with _channel(target, tls) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as exc:
        return False, f"{exc.code().name}: {exc.details()}"
    except OSError as exc:  # a certificate file that is not there (yet)
        return False, str(exc)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


# kept for callers of the first version of this module
check = check_grpc


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


def etcd_leader_address(endpoint: str, timeout: float = 3.0) -> tuple[str | None, str]:
    """The leader's worker-link address from etcd's v3 JSON gateway; (None, why) when none."""
    key = base64.b64encode(LEADER_KEY.encode()).decode()
    request = urllib.request.Request(
        f"http://{endpoint}/v3/kv/range",
        data=json.dumps({"key": key}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            body = json.loads(reply.read())
    except (OSError, urllib.error.URLError, ValueError) as exc:
        return None, f"etcd {endpoint}: {getattr(exc, 'reason', exc)}"
    kvs = body.get("kvs") or []
    if not kvs:
        return None, f"etcd {endpoint}: no leader scheduler"
    try:
        value = json.loads(base64.b64decode(kvs[0]["value"]))
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
    parser.add_argument("--tls", action="store_true", help="gRPC over TLS (system roots)")
    parser.add_argument("--tls-ca-file", default="", help="CA of the server (implies --tls)")
    parser.add_argument("--tls-cert-file", default="", help="client certificate: mutual TLS")
    parser.add_argument("--tls-key-file", default="", help="its private key")
    parser.add_argument("--tls-server-name", default="", help="name in the server's certificate")
    args = parser.parse_args(argv)
    tls = None
    if args.tls or args.tls_ca_file or args.tls_cert_file:
        if bool(args.tls_cert_file) != bool(args.tls_key_file):
            parser.error("--tls-cert-file and --tls-key-file go together")
        tls = {
            "ca_file": args.tls_ca_file,
            "cert_file": args.tls_cert_file,
            "key_file": args.tls_key_file,
            "server_name": args.tls_server_name,
        }

    if args.no_stopped_process:
        pid = stopped_process()
        if pid is not None:
            print(f"process {pid} is stopped", file=sys.stderr)
            return 1
    if args.http:
        what = args.http
        ok, status = check_http(args.http, args.expect, args.timeout)
    elif args.etcd_leader:
        address, why = etcd_leader_address(args.etcd_leader, args.timeout)
        if address is None:
            print(why, file=sys.stderr)
            return 1
        service = args.service or "splitserve.v1.WorkerLink"
        what = f"{why} at {address} {service}"
        ok, status = check_grpc(address, service, args.timeout, tls)
    else:
        what = f"{args.target} {args.service or '(server)'}"
        ok, status = check_grpc(args.target, args.service, args.timeout, tls)
    print(f"{what}: {status}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
