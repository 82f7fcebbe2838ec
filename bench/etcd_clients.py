"""etcd clients over mutual TLS: what splitserve does with etcd, timed per Python client.

    .venv/bin/python bench/etcd_clients.py [--iterations 200] [--rounds 2] [--json out.json]
        [--path DIR ...]      # extra import paths for candidates installed apart (pip --target)

One etcd (common/etcd_server.py, single member, `--unsafe-no-fsync` so that the disk does not
hide the clients) with mutual TLS and auth on, the scheduler's certificate as the client; the
plaintext row runs against a second etcd without TLS, on loopback. Each client runs in its own
process (their generated etcd protos would clash in one), the clients in turns for --rounds.

Timed, per client: import of the library; connect (new client to the first answered read:
TLS handshake included); get (one read of the leader key); campaign (lease grant + the
create-if-absent transaction of Coordinator._try_lead; the lease is revoked untimed after);
keepalive (one LeaseKeepAlive round trip); watch (a put until a watch on the key sees it).

Candidates (docs/security.md says which was chosen and why):
  aetcd-mtls          aetcd 1.0.0 with common/etcd_client.py (a secure channel in connect())
  aetcd-plaintext     the same without TLS: the cost of TLS
  etcd3aio-mtls       etcd3aio 0.3.0 (grpc.aio; ca_cert/cert_key/cert_chain, tls_server_name)
  etcd3-async-client  0.3.1 and etcd-client-py 0.5.1 are probed, not timed: see CANNOT
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

KEY = b"/splitserve/bench/leader"
TIMED = ("get", "campaign", "keepalive", "watch")
CLIENTS = ("aetcd-mtls", "aetcd-plaintext", "etcd3aio-mtls")


def cannot() -> dict[str, str]:
    """Why a candidate cannot do what splitserve needs, found by looking at it (not timed)."""
    reasons = {}
    try:
        from etcd_client.async_client import EtcdConfig  # etcd3-async-client

        fields = set(EtcdConfig.__dataclass_fields__)
        if not fields & {"cert_key", "client_cert_path", "cert_chain", "client_key_path"}:
            reasons["etcd3-async-client"] = (
                "no client certificate (CA file only), always a user/password Authenticate, "
                "no lease or transaction API: cannot campaign"
            )
    except ImportError:
        pass
    try:
        import etcd_client  # etcd-client-py (Rust)

        options = getattr(etcd_client, "ConnectOptions", None)
        if options is not None and not any("tls" in n for n in dir(options)):
            reasons["etcd-client-py"] = "ConnectOptions has no TLS setting (with_user only)"
    except ImportError:
        pass
    reasons.setdefault("etcd3aio-mtls (DNS)", dns_refusal())
    return {k: v for k, v in reasons.items() if v}


def dns_refusal() -> str:
    try:
        from etcd3aio.connections import ConnectionManager
    except ImportError:
        return ""
    target = ConnectionManager(["etcd:2379"]).target
    if target.startswith("ipv4:"):
        return f"dials {target!r}: gRPC's ipv4: scheme takes addresses only, not etcd:2379"
    return ""


# ---- one client, in its own process ---------------------------------------------------------


async def run_aetcd(endpoint: str, credentials: str, iterations: int) -> dict:
    started = time.perf_counter()
    from common.credentials import Credentials
    from common.etcd_client import EtcdClient

    imported = time.perf_counter() - started
    creds = Credentials.load(credentials, "scheduler") if credentials else None
    host, _, port = endpoint.rpartition(":")
    started = time.perf_counter()
    client = EtcdClient(host, int(port), creds, timeout=5.0)
    await client.get(KEY)
    connected = time.perf_counter() - started
    tx = client.transactions

    async def campaign() -> int:
        lease = await client.lease(5)
        await client.transaction(
            compare=[tx.create(KEY) == 0],
            success=[tx.put(KEY, b"me", lease=lease.id), tx.get(KEY)],
            failure=[tx.get(KEY)],
        )
        return lease.id

    async def keepalive(lease_id: int) -> None:
        await client.refresh_lease(lease_id)

    seen: asyncio.Queue[bytes] = asyncio.Queue()
    watch = await client.watch(KEY + b"/w")

    async def follow() -> None:
        async for event in watch:
            await seen.put(event.kv.value)

    follower = asyncio.create_task(follow())
    result = await timed_ops(
        iterations,
        get=lambda: client.get(KEY),
        campaign=campaign,
        keepalive=keepalive,
        revoke=client.revoke_lease,
        put=lambda value: client.put(KEY + b"/w", value),
        seen=seen,
    )
    follower.cancel()
    await watch.cancel()
    await client.close()
    return {"import_s": imported, "connect_s": connected, **result}


async def run_etcd3aio(endpoint: str, credentials: str, iterations: int) -> dict:
    started = time.perf_counter()
    from etcd3aio import Etcd3Client
    from etcd3aio.kv import KVService

    imported = time.perf_counter() - started
    files = {n: (Path(credentials) / n).read_bytes() for n in ("ca.crt", "tls.crt", "tls.key")}
    started = time.perf_counter()
    client = Etcd3Client(
        [endpoint],
        tls_server_name="splitserve-etcd",
        ca_cert=files["ca.crt"],
        cert_chain=files["tls.crt"],
        cert_key=files["tls.key"],
    )
    await client.connect()
    await client.kv.get(KEY)
    connected = time.perf_counter() - started

    async def campaign() -> int:
        lease = await client.lease.grant(5)
        await client.kv.txn(
            compare=[KVService.txn_compare_create_revision(KEY, 0)],
            success=[KVService.txn_op_put(KEY, b"me", lease=lease.ID), KVService.txn_op_get(KEY)],
            failure=[KVService.txn_op_get(KEY)],
        )
        return lease.ID

    async def keepalive(lease_id: int) -> None:
        stream = client.lease.keep_alive(lease_id)
        async for _ in stream:
            break
        stream.cancel()

    seen: asyncio.Queue[bytes] = asyncio.Queue()

    async def follow() -> None:
        async for response in client.watch.watch(KEY + b"/w", start_revision=0):
            for event in response.events:
                await seen.put(event.kv.value)

    follower = asyncio.create_task(follow())
    await asyncio.sleep(0.2)  # the watch is created on its first iteration
    result = await timed_ops(
        iterations,
        get=lambda: client.kv.get(KEY),
        campaign=campaign,
        keepalive=keepalive,
        revoke=client.lease.revoke,
        put=lambda value: client.kv.put(KEY + b"/w", value),
        seen=seen,
    )
    follower.cancel()
    await client.close()
    return {"import_s": imported, "connect_s": connected, **result}


async def timed_ops(iterations, *, get, campaign, keepalive, revoke, put, seen) -> dict:
    samples: dict[str, list[float]] = {op: [] for op in TIMED}
    for i in range(iterations):
        started = time.perf_counter()
        await get()
        samples["get"].append(time.perf_counter() - started)

        started = time.perf_counter()
        lease_id = await campaign()
        samples["campaign"].append(time.perf_counter() - started)

        started = time.perf_counter()
        await keepalive(lease_id)
        samples["keepalive"].append(time.perf_counter() - started)
        await revoke(lease_id)

        value = str(i).encode()
        started = time.perf_counter()
        await put(value)
        while await asyncio.wait_for(seen.get(), 5) != value:
            pass
        samples["watch"].append(time.perf_counter() - started)
    return {"samples": samples}


def child(name: str, endpoint: str, credentials: str, iterations: int) -> None:
    runner = run_etcd3aio if name.startswith("etcd3aio") else run_aetcd
    result = asyncio.run(runner(endpoint, credentials, iterations))
    print(json.dumps(result))


# ---- the parent: etcd, the turns, the table -------------------------------------------------


def start_etcds(directory: Path):
    from common.credentials import Credentials, create_cluster
    from common.etcd_server import EtcdServer

    creds = create_cluster(directory / "credentials")
    secure = EtcdServer(
        unsafe_no_fsync=True,
        credentials=Credentials.load(creds / "etcd", "etcd"),
        root_credentials=Credentials.load(creds / "root", "root"),
    )
    plain = EtcdServer(unsafe_no_fsync=True)
    secure.start()
    plain.start()
    return creds, secure, plain


def probe_each(paths: list[str]) -> dict[str, str]:
    """cannot() once per import path, each in a process of its own: two candidates install
    the same top-level package name (etcd_client)."""
    reasons: dict[str, str] = {}
    for path in paths:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), path]))
        done = subprocess.run(
            [sys.executable, __file__, "--probe"], env=env, capture_output=True, text=True
        )
        if done.returncode == 0:
            reasons.update(json.loads(done.stdout))
    return reasons


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(runs: list[dict]) -> dict:
    out = {
        "import_ms": 1000 * statistics.median(r["import_s"] for r in runs),
        "connect_ms": 1000 * statistics.median(r["connect_s"] for r in runs),
    }
    for op in TIMED:
        values = [v for r in runs for v in r["samples"][op]]
        out[f"{op}_p50_ms"] = 1000 * statistics.median(values)
        out[f"{op}_p99_ms"] = 1000 * percentile(values, 0.99)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--path", action="append", default=[], help="extra import path")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--child", nargs=3, metavar=("NAME", "ENDPOINT", "CREDENTIALS"))
    parser.add_argument("--probe", action="store_true", help="print cannot() as JSON")
    args = parser.parse_args()
    sys.path[1:1] = args.path
    if args.child:
        child(*args.child, args.iterations)
        return 0
    if args.probe:
        print(json.dumps(cannot()))
        return 0

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), *args.path]))
    runs: dict[str, list[dict]] = {name: [] for name in CLIENTS}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="etcd-clients-") as tmp:
        creds, secure, plain = start_etcds(Path(tmp))
        try:
            for _ in range(args.rounds):
                for name in CLIENTS:
                    endpoint = plain.endpoint if name.endswith("plaintext") else secure.endpoint
                    directory = "" if name.endswith("plaintext") else str(creds / "scheduler")
                    command = [sys.executable, __file__, "--iterations", str(args.iterations)]
                    command += ["--child", name, endpoint, directory]
                    done = subprocess.run(command, env=env, capture_output=True, text=True)
                    if done.returncode != 0:
                        skipped[name] = done.stderr.strip().splitlines()[-1]
                        continue
                    runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
        finally:
            secure.stop()
            plain.stop()
    results = {name: summarize(r) for name, r in runs.items() if r}
    reasons = probe_each(args.path)
    report(results, skipped, reasons, args)
    if args.json:
        payload = {
            "machine": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "iterations": args.iterations,
            "rounds": args.rounds,
            "results": results,
            "skipped": skipped,
            "cannot": reasons,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0


def report(results: dict, skipped: dict, reasons: dict, args) -> None:
    columns = ["import_ms", "connect_ms"] + [f"{op}_{q}_ms" for op in TIMED for q in ("p50", "p99")]
    print(f"{args.rounds} rounds x {args.iterations} iterations per client (ms)")
    print(f"{'client':<18}" + "".join(f"{c.removesuffix('_ms'):>15}" for c in columns))
    for name, row in results.items():
        print(f"{name:<18}" + "".join(f"{row[c]:>15.2f}" for c in columns))
    for name, why in {**skipped, **reasons}.items():
        print(f"{name:<18}  cannot: {why}")


if __name__ == "__main__":
    sys.exit(main())
