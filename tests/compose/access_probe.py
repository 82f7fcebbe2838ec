"""Who gets what from the internal ports, tried from inside the compose network.

check_compose.py feeds this file to `python -` in a container (it needs grpcio, aetcd's etcd
protos and splitserve's generated modules, all in both images) and reads the one JSON object it
prints: {check: {"expect": "answered" | "refused" | "refused: CODE", "got": what happened}}.

    python - outsider CA       a container with no credentials (`docker run` on the network):
                               plaintext, and a certificate of another CA with the right names
                               (trusting that CA, then the cluster's CA.crt, given base64, as a
                               client that knows the public certificate would), to both
                               schedulers' 50052 and etcd's 2379; etcd's 2381
    python - worker DIR        in a worker, with its credentials: grpc.health.v1 and the leader key
                               answer; the FrontendLink, etcd's other keys and every etcd write
                               are refused for its role (PERMISSION_DENIED)
    python - frontend DIR      in a front-end: the same the other way round
"""

from __future__ import annotations

import base64
import json
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import grpc

SCHEDULERS = ("scheduler-a:50052", "scheduler-b:50052")
ETCD = "etcd:2379"
LEADER_KEY = b"/splitserve/leader"
TIMEOUT = 3.0
DENIED = "refused: PERMISSION_DENIED"  # let in by TLS, then refused for the role it holds
results: dict[str, dict[str, str]] = {}


def expect(check: str, wanted: str, attempt, *args) -> None:
    """Runs attempt(*args); an answer is "answered", any failure "refused" (with its reason)."""
    try:
        got = f"answered: {attempt(*args)}"
    except grpc.RpcError as exc:
        got = f"refused: {exc.code().name}: {(exc.details() or '')[:160]}"
    except (OSError, urllib.error.URLError, ValueError) as exc:
        got = f"refused: {type(exc).__name__}: {str(exc)[:160]}"
    results[check] = {"expect": wanted, "got": got}


def channel(target: str, directory: Path | None, name: str) -> grpc.Channel:
    if directory is None:
        return grpc.insecure_channel(target)
    creds = grpc.ssl_channel_credentials(
        (directory / "ca.crt").read_bytes(),
        (directory / "tls.key").read_bytes(),
        (directory / "tls.crt").read_bytes(),
    )
    return grpc.secure_channel(target, creds, [("grpc.ssl_target_name_override", name)])


def health(target: str, directory: Path | None) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with channel(target, directory, "splitserve-scheduler") as ch:
        request = health_pb2.HealthCheckRequest(service="splitserve.v1.WorkerLink")
        reply = health_pb2_grpc.HealthStub(ch).Check(request, timeout=TIMEOUT)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def worker_link(target: str, directory: Path | None) -> str:
    """Registers as a worker and reads the first answer."""
    from common.pb import worker_link_pb2 as pb
    from common.pb import worker_link_pb2_grpc

    register = pb.WorkerMessage(register=pb.Register(worker_id="intruder"))
    with channel(target, directory, "splitserve-scheduler") as ch:
        stream = worker_link_pb2_grpc.WorkerLinkStub(ch).Connect(iter([register]), timeout=TIMEOUT)
        return str(next(stream)).strip()[:120] or "(an empty message)"


def frontend_link(target: str, directory: Path | None) -> str:
    """Says hello as a front-end and reads the first answer."""
    from common.pb import frontend_link_pb2 as pb
    from common.pb import frontend_link_pb2_grpc

    hello = pb.FrontendMessage(hello=pb.FrontendHello(frontend_id="intruder"))
    with channel(target, directory, "splitserve-scheduler") as ch:
        stream = frontend_link_pb2_grpc.FrontendLinkStub(ch).Connect(iter([hello]), timeout=TIMEOUT)
        return str(next(stream)).strip()[:120] or "(an empty message)"


def etcd_range(directory: Path | None, key: bytes = LEADER_KEY, prefix: bool = False) -> str:
    from aetcd import rpc

    end = key[:-1] + bytes([key[-1] + 1]) if prefix else b""
    with channel(ETCD, directory, "splitserve-etcd") as ch:
        reply = rpc.KVStub(ch).Range(rpc.RangeRequest(key=key, range_end=end), timeout=TIMEOUT)
        return f"{len(reply.kvs)} keys"


def etcd_put(directory: Path | None) -> str:
    from aetcd import rpc

    with channel(ETCD, directory, "splitserve-etcd") as ch:
        request = rpc.PutRequest(key=LEADER_KEY + b"-intruder", value=b"x")
        rpc.KVStub(ch).Put(request, timeout=TIMEOUT)
        return "written"


def http(url: str, body: bytes | None = None) -> str:
    with urllib.request.urlopen(url, data=body, timeout=TIMEOUT) as reply:
        return f"HTTP {reply.status} {reply.read(200)!r}"


def impostor(rogue: Path, role: str, cluster_ca: bytes) -> Path:
    """rogue's certificate for `role`, trusting the cluster's CA: the server's certificate
    checks out, so only the server can refuse this one."""
    directory = rogue.parent / f"impostor-{role}"
    directory.mkdir()
    (directory / "ca.crt").write_bytes(cluster_ca)
    for name in ("tls.crt", "tls.key"):
        (directory / name).write_bytes((rogue / role / name).read_bytes())
    return directory


def outsider(cluster_ca: bytes) -> None:
    from common.credentials import create_cluster

    # a whole cluster of its own: certificates that name every role, from another CA
    rogue = create_cluster(Path(tempfile.mkdtemp()) / "rogue")
    worker, scheduler = (impostor(rogue, r, cluster_ca) for r in ("worker", "scheduler"))
    for target in SCHEDULERS:
        expect(f"{target} health, plaintext", "refused", health, target, None)
        expect(f"{target} WorkerLink, plaintext", "refused", worker_link, target, None)
        expect(f"{target} FrontendLink, plaintext", "refused", frontend_link, target, None)
        expect(f"{target} health, another CA", "refused", health, target, rogue / "worker")
        expect(f"{target} WorkerLink, another CA", "refused", worker_link, target, rogue / "worker")
        expect(f"{target} WorkerLink, an impostor", "refused", worker_link, target, worker)
    expect("etcd range, plaintext gRPC", "refused", etcd_range, None)
    expect("etcd range, another CA", "refused", etcd_range, rogue / "scheduler")
    expect("etcd put, another CA", "refused", etcd_put, rogue / "root")
    expect("etcd put, an impostor", "refused", etcd_put, scheduler)
    expect("etcd /health, plain HTTP", "refused", http, f"http://{ETCD}/health")
    body = json.dumps({"key": "L3NwbGl0c2VydmUvbGVhZGVy"}).encode()  # /splitserve/leader
    expect("etcd /v3/kv/range, plain HTTP", "refused", http, f"http://{ETCD}/v3/kv/range", body)
    expect("etcd :2381 from the network", "refused", http, "http://etcd:2381/health")


def member(role: str, directory: Path) -> None:
    other_link = frontend_link if role == "worker" else worker_link
    for target in SCHEDULERS:
        expect(f"{target} health, {role}'s certificate", "answered", health, target, directory)
        link = f"{target} the other role's link, as a {role}"
        expect(link, DENIED, other_link, target, directory)
    expect(f"etcd leader key, {role}'s certificate", "answered", etcd_range, directory)
    members = b"/splitserve/members/"
    expect(f"etcd members, {role}'s certificate", DENIED, etcd_range, directory, members, True)
    expect(f"etcd put, {role}'s certificate", DENIED, etcd_put, directory)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "outsider":
        outsider(base64.b64decode(argv[1]))
    elif len(argv) == 2 and argv[0] in ("worker", "frontend"):
        member(argv[0], Path(argv[1]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
