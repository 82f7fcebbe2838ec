"""The etcd client: aetcd's, dialing over mutual TLS when given a role's credentials.

aetcd 1.0 opens plaintext channels only (TLS is an open issue there). This subclass replaces
the one step that opens the channel and keeps the rest of aetcd: its stubs, its error mapping
and its watcher. docs/security.md says why this, not another client (bench/etcd_clients.py).

etcd identifies the client by its certificate's common name (`--client-cert-auth`), so no
password or token travels: the role's certificate is the etcd user (common/etcd_auth.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aetcd
import grpc
from aetcd import rpc, watcher

from common.credentials import ETCD_NAME, Credentials
from common.link_auth import is_loopback, target_host


class EtcdClient(aetcd.Client):
    def __init__(
        self,
        host: str,
        port: int,
        credentials: Credentials | None = None,
        *,
        timeout: float | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        require_tls_beyond_loopback(f"{host}:{port}", credentials)
        super().__init__(host, port, timeout=timeout, options=dict(options or {}))
        self.credentials = credentials  # None: plaintext (Coordinator allows it on loopback)

    @classmethod
    def at(cls, endpoint: str, credentials: Credentials | None = None, **kwargs) -> EtcdClient:
        """A client of the etcd at HOST:PORT (IPv6 in brackets allowed)."""
        host, _, port = endpoint.rpartition(":")
        return cls(host.strip("[]"), int(port), credentials, **kwargs)

    def open_channel(self) -> grpc.aio.Channel:
        target = f"{self._host}:{self._port}"
        options = list(self._options.items())
        if self.credentials is None:
            return grpc.aio.insecure_channel(target, options=options)
        # whatever address etcd is dialed at, only the certificate naming etcd is trusted
        options.append(("grpc.ssl_target_name_override", ETCD_NAME))
        return grpc.aio.secure_channel(
            target, self.credentials.channel_credentials(), options=options
        )

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        # nothing below awaits: no other task can see a half-built client, so aetcd's
        # "another task is connecting" wait is not needed
        self.channel = self.open_channel()
        self.auth_stub = rpc.AuthStub(self.channel)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout)
        self._connected.set()


def denied(exc: BaseException) -> bool:
    """Whether etcd refused the call for who the caller is (no user for its certificate, or
    no permission for the key): retrying cannot help."""
    # aetcd raises its own errors from grpc's, whose status code says who refused what
    cause = exc if isinstance(exc, grpc.aio.AioRpcError) else exc.__cause__
    if not isinstance(cause, grpc.aio.AioRpcError):
        return False
    return cause.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)


def refused(endpoint: str, what: str, credentials: Credentials | None) -> PermissionError:
    shown = f"the {credentials.role}'s certificate" if credentials else "no certificate"
    return PermissionError(
        f"etcd at {endpoint} refused to {what} for {shown}: only a scheduler's certificate may "
        "write, a worker's or front-end's may read the leader key (common/etcd_auth.py; run "
        "`python -m common.etcd_auth --cluster NAME` if etcd's auth was set up for another "
        "cluster)"
    )


def require_tls_beyond_loopback(endpoint: str, credentials: Credentials | None) -> None:
    """ValueError, with a sentence naming --credentials, for plaintext to an etcd elsewhere."""
    if credentials is None and not is_loopback(target_host(endpoint)):
        raise ValueError(
            f"refusing to reach etcd at {endpoint} in plaintext: beyond loopback etcd is mutual "
            "TLS. Pass --credentials DIR (this role's directory of `splitserve credentials DIR`; "
            "`splitserve up` makes them itself), or keep etcd on 127.0.0.1"
        )
