#!/usr/bin/env python3
"""The Kubernetes etcd, run for real in Docker: deploy/kubernetes's three members as rendered.

    python tests/compose/check_kube_etcd.py        (after check_compose.py built the images)

Where no cluster is at hand, the closest thing: the etcd StatefulSet's container (its command,
arguments and environment as render.py renders the cpu overlay) started three times on a Docker
network, each member reachable at its per-pod peer name (`splitserve-etcd-N.splitserve-etcd-
peer`) and all at the Service's name `splitserve-etcd`, each with the etcd role's credentials
from `splitserve credentials` mounted as the Secret would be. Then:

1. every member's readiness and liveness probe, as the kubelet execs them, passes (the three
   members found each other over peer TLS: /health needs a leader);
2. the Job `splitserve-etcd-auth`, as rendered, with the root role's credentials, turns auth
   on, and a second run changes nothing;
3. a scheduler's certificate reads and writes the leader key, a worker's only reads it, the
   members' own certificate is no user, a certificate of another CA gets nothing; the peer port
   takes a member's certificate and refuses a worker's (--peer-cert-allowed-cn).

Skips (exit 0) where no Docker engine is reachable or the image is missing.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "splitserve-scheduler:latest"
MEMBERS = [f"splitserve-etcd-{i}" for i in range(3)]
PEERS = "splitserve-etcd-peer"
ETCD = "splitserve-etcd:2379"
TIMEOUT = 3.0

PROBE = """
import socket, ssl, sys
import grpc
from aetcd import rpc
d = '/etc/splitserve/credentials/'
target, what = sys.argv[1:3]
try:
    if what == 'peer':  # the raft transport's TLS: does the member take this certificate?
        ctx = ssl.create_default_context(cafile=d + 'ca.crt')
        ctx.load_cert_chain(d + 'tls.crt', d + 'tls.key')
        ctx.check_hostname = False  # OpenSSL takes no *.one-label wildcard; Go (etcd) does
        host, port = target.rsplit(':', 1)
        with ctx.wrap_socket(socket.create_connection((host, int(port)), TIMEOUT)) as conn:
            conn.sendall(b'GET /version HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n')
            try:
                conn.recv(1)  # TLS 1.3: a refused client certificate shows as an alert here
            except ssl.SSLError:
                raise
            except OSError:
                pass  # no alert: the session stands
        print('answered')
        sys.exit()
    files = (open(d + n, 'rb').read() for n in ('ca.crt', 'tls.key', 'tls.crt'))
    options = [('grpc.ssl_target_name_override', 'splitserve-etcd')]
    with grpc.secure_channel(target, grpc.ssl_channel_credentials(*files), options) as ch:
        kv = rpc.KVStub(ch)
        if what == 'put':
            kv.Put(rpc.PutRequest(key=b'/splitserve/leader', value=b'{}'), timeout=TIMEOUT)
        else:
            kv.Range(rpc.RangeRequest(key=b'/splitserve/leader'), timeout=TIMEOUT)
        print('answered')
except grpc.RpcError as exc:
    print('refused', exc.code().name)
except OSError as exc:
    print('refused', type(exc).__name__, str(exc)[:120])
""".replace("TIMEOUT", str(TIMEOUT))


class Failed(Exception):
    pass


def say(msg: str) -> None:
    print(f"[kube-etcd] {msg}", flush=True)


def sh(*args: str, check: bool = True, stdin: str | None = None) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, input=stdin, timeout=300)
    if check and proc.returncode != 0:
        raise Failed(f"exit {proc.returncode}: {' '.join(args)}\n{proc.stdout}{proc.stderr}")
    return (proc.stdout + proc.stderr).strip()


def rendered() -> tuple[dict, dict]:
    """The etcd StatefulSet's container and the Job's, as render.py renders overlays/cpu."""
    kube = ROOT / "deploy" / "kubernetes"
    spec = importlib.util.spec_from_file_location("render", kube / "render.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    resources = render.render(kube / "overlays" / "cpu")

    def container(kind: str, name: str) -> dict:
        (res,) = [r for r in resources if (r["kind"], r["metadata"]["name"]) == (kind, name)]
        return res["spec"]["template"]["spec"]["containers"][0]

    return container("StatefulSet", "splitserve-etcd"), container("Job", "splitserve-etcd-auth")


def run_in(net: str, credentials: Path, *args: str, stdin: str | None = None) -> str:
    """A one-off container of the image on `net` with `credentials` as its Secret."""
    mount = f"{credentials}:/etc/splitserve/credentials:ro"
    return sh("docker", "run", "--rm", "-i", "--network", net, "-v", mount, *args, stdin=stdin)


def ask(net: str, credentials: Path, target: str, what: str) -> str:
    """PROBE's verdict ("answered", "refused CODE"); gRPC's own log lines left out."""
    out = run_in(net, credentials, "--entrypoint", "python", IMAGE, "-", target, what, stdin=PROBE)
    verdicts = [line for line in out.splitlines() if line.startswith(("answered", "refused"))]
    return verdicts[-1] if verdicts else out[-300:]


def check(net: str, cluster: Path, rogue: Path, etcd: dict, job: dict) -> None:
    deadline = time.monotonic() + 60
    for member in MEMBERS:
        for kind in ("readinessProbe", "livenessProbe"):
            while True:
                probe = etcd[kind]["exec"]["command"]
                out = sh("docker", "exec", f"{net}-{member}", *probe, check=False)
                if '"health":"true"' in out or (kind == "livenessProbe" and "HTTP 200" in out):
                    break
                if time.monotonic() > deadline:
                    raise Failed(f"{member} {kind}: {out[-300:]}")
                time.sleep(1)
    say("every member's readiness and liveness probe passes (a leader over peer TLS)")

    args = [a.replace("$(SPLITSERVE_ETCD)", ETCD) for a in job["args"]]
    entry = ["--entrypoint", job["command"][0], IMAGE, *job["command"][1:], *args]
    first = run_in(net, cluster / "root", *entry).splitlines()[-1]
    again = run_in(net, cluster / "root", *entry).splitlines()[-1]
    if "auth enabled" not in first or "already in place" not in again:
        raise Failed(f"the Job: first run {first!r}, second {again!r}")
    say("the Job turns auth on; run again, it changes nothing")

    expected = {
        ("scheduler", "range"): "answered",
        ("scheduler", "put"): "answered",
        ("worker", "range"): "answered",
        ("worker", "put"): "refused PERMISSION_DENIED",
        ("frontend", "put"): "refused PERMISSION_DENIED",
        ("etcd", "range"): "refused PERMISSION_DENIED",  # a member's certificate is no user
    }
    for (role, what), want in expected.items():
        got = ask(net, cluster / role, ETCD, what)
        if got != want:
            raise Failed(f"{role}'s certificate, {what} of the leader key: {got}, not {want}")
    for role in ("scheduler", "root"):
        got = ask(net, rogue / role, ETCD, "range")
        if not got.startswith("refused"):
            raise Failed(f"another CA's {role} certificate: {got}")
    say("schedulers write the leader key, workers and front-ends only read it, another CA: nothing")

    peer = f"{MEMBERS[1]}.{PEERS}:2380"
    member, worker = (ask(net, cluster / r, peer, "peer") for r in ("etcd", "worker"))
    if member != "answered" or not worker.startswith("refused"):
        raise Failed(f"the peer port: a member's certificate {member}, a worker's {worker}")
    say("the peer port takes a member's certificate and refuses a worker's")


def main() -> int:
    if (
        shutil.which("docker") is None
        or subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True).returncode
    ):
        print(f"kube-etcd check SKIPPED: no Docker engine or no image {IMAGE}", flush=True)
        return 0
    etcd, job = rendered()
    net = f"splitserve-kube-etcd-{time.monotonic_ns() % 100000}"
    scratch = Path(tempfile.mkdtemp(prefix="splitserve-kube-etcd-"))
    sys.path.insert(0, str(ROOT))
    from common.credentials import create_cluster

    try:
        for name in ("cluster", "rogue"):
            create_cluster(scratch / name)
        # the pods' user reads them, as fsGroup 1000 lets it; not root: make them readable
        if subprocess.run(["chown", "-R", "1000:1000", str(scratch)]).returncode != 0:
            sh("chmod", "-R", "a+rX", str(scratch))
        sh("docker", "network", "create", net)
        env = [
            f"{k}={e['value']}" for k, e in ((e["name"], e) for e in etcd["env"]) if "value" in e
        ]
        for member in MEMBERS:
            mount = f"{scratch / 'cluster' / 'etcd'}:/etc/splitserve/credentials:ro"
            alias = ["--network-alias", f"{member}.{PEERS}", "--network-alias", "splitserve-etcd"]
            environment = [a for v in [f"POD_NAME={member}", *env] for a in ("-e", v)]
            entry = ["--entrypoint", etcd["command"][0], IMAGE, *etcd["command"][1:], *etcd["args"]]
            sh("docker", "run", "-d", "--name", f"{net}-{member}", "--hostname", member,
               "--network", net, *alias, *environment, "-v", mount, *entry)  # fmt: skip
        check(net, scratch / "cluster", scratch / "rogue", etcd, job)
        say("PASSED")
        return 0
    except Failed as exc:
        print(f"kube-etcd check FAILED: {exc}", flush=True)
        return 1
    finally:
        for member in MEMBERS:
            sh("docker", "rm", "-f", f"{net}-{member}", check=False)
        sh("docker", "network", "rm", net, check=False)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
