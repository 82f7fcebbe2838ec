#!/usr/bin/env python3
"""Container health probe: ask a gRPC server's standard `grpc.health.v1.Health/Check`.

    splitserve-health [--target localhost:50051] [--service NAME] [--timeout 3]

Exit 0 when the service answers SERVING, 1 otherwise (with the reason on stderr). Needs only
grpcio and grpcio-health-checking (both in the scheduler image); no probe binary to download.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(target: str, service: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    try:
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as exc:
        return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str] | None = None) -> int:
    port = os.environ.get("SPLITSERVE_PORT", "50051")
    parser = argparse.ArgumentParser(prog="splitserve-health", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=f"localhost:{port}", help="HOST:PORT to probe")
    parser.add_argument("--service", default="", help="service name; empty = the whole server")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    ok, status = check(args.target, args.service, args.timeout)
    where = sys.stdout if ok else sys.stderr
    print(f"{args.target} {args.service or '(server)'}: {status}", file=where)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
