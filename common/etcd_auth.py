"""etcd's users, roles and permissions for a splitserve cluster, then its auth turned on.

etcd started with `--client-cert-auth` takes a client certificate's common name as the user
(common/credentials.py names every certificate `splitserve-<role>`), so a user needs no
password and none travels. Once auth is on:

    splitserve-scheduler   read and write /{cluster}/ (leader key, members, state) and the
                           leases that hold those keys: campaign, keepalives, depose
    splitserve-worker      read and watch /{cluster}/leader, nothing else: a worker only follows
    splitserve-frontend    the leader (worker_svc/link.py, frontend_svc/leader_finder.py)
    splitserve-root        etcd's root role: this bootstrap only
    root                   etcd refuses to turn auth on without a user of that name; it has no
                           password and the cluster's CA issues no certificate named root

A certificate etcd knows no user for (the etcd role's own, another CA's never gets this far) is
refused every key. etcd checks lease revocation against write permission on the lease's keys,
so a worker's certificate cannot depose the leader.

`ensure_auth` adds what is missing and changes nothing that is in place: a restarted etcd, a
second run of the Kubernetes Job, or `splitserve up` on an existing data directory are no-ops.
Run it as `python -m common.etcd_auth --endpoint HOST:PORT --root-credentials DIR`: it retries
until etcd answers (a Job started beside a 3-member etcd). Several clusters may share one etcd:
each run grants the roles the prefix of its --cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass

import grpc
from aetcd import rpc

from common.credentials import Credentials, CredentialsError, role_name
from common.etcd_client import EtcdClient
from common.logging import configure_logging, get_logger

log = get_logger("etcd_auth")

ROOT_ROLE = "root"  # etcd's built-in role that may administer auth
ETCD_ROOT_USER = "root"  # the user etcd requires before it turns auth on
READ = rpc.Permission.READ
READWRITE = rpc.Permission.READWRITE
RETRY_S = 0.5
_WAITING = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass(slots=True, frozen=True)
class Grant:
    role: str
    key: bytes
    range_end: bytes  # b"": the one key
    kind: int  # READ or READWRITE

    def matches(self, perm: rpc.Permission) -> bool:
        return (perm.key, perm.range_end, perm.permType) == (self.key, self.range_end, self.kind)


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with `prefix`."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


def grants(cluster: str = "splitserve") -> list[Grant]:
    prefix = f"/{cluster}/".encode()
    leader = f"/{cluster}/leader".encode()
    return [
        Grant(role_name("scheduler"), prefix, prefix_end(prefix), READWRITE),
        Grant(role_name("worker"), leader, b"", READ),
        Grant(role_name("frontend"), leader, b"", READ),
    ]


def users() -> dict[str, str]:
    """user -> the one role it holds."""
    named = {role_name(r): role_name(r) for r in ("scheduler", "worker", "frontend")}
    return {ETCD_ROOT_USER: ROOT_ROLE, role_name("root"): ROOT_ROLE, **named}


async def ensure_auth(client: EtcdClient, cluster: str = "splitserve") -> list[str]:
    """Adds the roles, permissions and users that are missing, then turns auth on if it is
    off. `client` must hold the root role's certificate once auth is on. Returns what it
    changed (empty: everything was in place)."""
    await client.connect()
    stub, timeout = client.auth_stub, client._timeout
    changes: list[str] = []
    roles = set((await stub.RoleList(rpc.AuthRoleListRequest(), timeout=timeout)).roles)
    for grant in grants(cluster):
        if grant.role not in roles:
            await stub.RoleAdd(rpc.AuthRoleAddRequest(name=grant.role), timeout=timeout)
            roles.add(grant.role)
            changes.append(f"role {grant.role}")
        held = (await stub.RoleGet(rpc.AuthRoleGetRequest(role=grant.role), timeout=timeout)).perm
        if not any(grant.matches(perm) for perm in held):
            perm = rpc.Permission(permType=grant.kind, key=grant.key, range_end=grant.range_end)
            request = rpc.AuthRoleGrantPermissionRequest(name=grant.role, perm=perm)
            await stub.RoleGrantPermission(request, timeout=timeout)
            changes.append(f"{grant.role} may {_describe(grant)}")
    existing = set((await stub.UserList(rpc.AuthUserListRequest(), timeout=timeout)).users)
    for user, role in users().items():
        if user not in existing:
            # no password: the certificate is the credential
            options = rpc.UserAddOptions(no_password=True)
            await stub.UserAdd(rpc.AuthUserAddRequest(name=user, options=options), timeout=timeout)
            changes.append(f"user {user}")
        held_roles = (await stub.UserGet(rpc.AuthUserGetRequest(name=user), timeout=timeout)).roles
        if role not in held_roles:
            request = rpc.AuthUserGrantRoleRequest(user=user, role=role)
            await stub.UserGrantRole(request, timeout=timeout)
            changes.append(f"{user} holds {role}")
    if not (await stub.AuthStatus(rpc.AuthStatusRequest(), timeout=timeout)).enabled:
        await stub.AuthEnable(rpc.AuthEnableRequest(), timeout=timeout)
        changes.append("auth enabled")
    return changes


def _describe(grant: Grant) -> str:
    kind = "read and write" if grant.kind == READWRITE else "read"
    where = f"[{grant.key.decode()}, {grant.range_end.decode()})" if grant.range_end else ""
    return f"{kind} {where or grant.key.decode()}"


async def bootstrap(
    endpoint: str, root: Credentials, cluster: str = "splitserve", timeout: float = 60.0
) -> list[str]:
    """ensure_auth against `endpoint` with the root role's certificate, retrying while etcd
    does not answer (starting, electing a leader) for up to `timeout` seconds."""
    client = EtcdClient.at(endpoint, root, timeout=5.0)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                return await ensure_auth(client, cluster)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _WAITING or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(RETRY_S)
    finally:
        await client.close()


def ensure_auth_blocking(
    endpoint: str, root: Credentials, cluster: str = "splitserve", timeout: float = 60.0
) -> list[str]:
    """bootstrap() for synchronous code (a thread with no running event loop)."""
    return asyncio.run(bootstrap(endpoint, root, cluster, timeout))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m common.etcd_auth",
        description="Create splitserve's etcd users, roles and permissions and turn auth on "
        "(idempotent).",
    )
    parser.add_argument("--endpoint", required=True, help="one etcd member, HOST:PORT")
    parser.add_argument(
        "--root-credentials", required=True, metavar="DIR", help="the root role's credentials"
    )
    parser.add_argument("--cluster", default="splitserve", help="the keys' prefix: /CLUSTER/")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for etcd to answer"
    )
    args = parser.parse_args(argv)
    configure_logging()
    try:
        root = Credentials.load(args.root_credentials, "root")
    except CredentialsError as exc:
        raise SystemExit(f"--root-credentials: {exc}") from exc
    try:
        changes = ensure_auth_blocking(args.endpoint, root, args.cluster, args.timeout)
    except grpc.aio.AioRpcError as exc:
        print(f"etcd at {args.endpoint}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print("; ".join(changes) if changes else "etcd auth already in place", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
