"""Who may use an internal port: mutual TLS under the cluster's CA, and each service only by the
role it is for (common/credentials.py). Without credentials a port stays on loopback.

The scheduler's worker-link port serves the WorkerLink to workers and the FrontendLink to
front-ends; a certificate of the other role, or of the scheduler, gets PERMISSION_DENIED with a
sentence. grpc.health.v1 and reflection answer any certificate of the cluster (probes).
"""

from __future__ import annotations

import inspect
import ipaddress
from collections.abc import Awaitable, Callable

import grpc

from common.credentials import PREFIX, SCHEDULER_NAME, Credentials

SERVICE_ROLES = {
    "/splitserve.v1.WorkerLink/": "worker",
    "/splitserve.v1.FrontendLink/": "frontend",
    "/splitserve.v1.ShardLink/": "scheduler",
}
LOOPBACK_NAMES = ("localhost", "ip6-localhost")
# FrontendLink.SetPriority: which front-end asks (a front-end may reprioritise only its own)
FRONTEND_ID_METADATA = "splitserve-frontend-id"


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, without a port) stays on this machine."""
    host = host.strip("[]")
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def target_host(target: str) -> str:
    """The host of a HOST:PORT target (IPv6 in brackets allowed)."""
    host, sep, _ = target.rpartition(":")
    return host if sep else target


class PlaintextRefused(ConnectionError):
    """A scheduler beyond loopback, and no credentials to reach it with."""


def require_credentials_beyond_loopback(
    credentials: Credentials | None, what: str, host: str
) -> None:
    """Refuse, with a sentence naming the flag, an internal link beyond loopback in clear."""
    if credentials is None and not is_loopback(host):
        raise SystemExit(
            f"refusing to {what} {host!r} without credentials: internal links beyond loopback "
            "are mutual TLS. Pass --credentials DIR (this role's directory of `splitserve "
            "credentials DIR`; `splitserve up` makes them itself), or keep the link on 127.0.0.1"
        )


def role_credentials(role: str, directory: str, links: dict[str, str]) -> Credentials | None:
    """`role`'s credentials from `directory` (CredentialsError when they are not that role's);
    with no directory, None once every link of `links` ({what it does: host}) stays on
    loopback (SystemExit naming --credentials otherwise)."""
    if directory:
        return Credentials.load(directory, role)
    for what, host in links.items():
        require_credentials_beyond_loopback(None, what, host)
    return None


def scheduler_channel(
    address: str, credentials: Credentials | None, options: list | None = None, aio: bool = False
):
    """A channel to a scheduler's internal port, as a worker or front-end dials it: mutual TLS
    that accepts only the certificate naming the scheduler, whatever address etcd or a flag
    gave; without credentials, plaintext to loopback only (PlaintextRefused beyond it)."""
    module = grpc.aio if aio else grpc
    options = list(options or [])
    if credentials is not None:
        options.append(("grpc.ssl_target_name_override", SCHEDULER_NAME))
        return module.secure_channel(address, credentials.channel_credentials(), options=options)
    if not is_loopback(target_host(address)):
        raise PlaintextRefused(
            f"the scheduler at {address} is beyond loopback and this process has no "
            "--credentials: requests would travel in clear"
        )
    return module.insecure_channel(address, options=options)


def peer_role(context: grpc.aio.ServicerContext) -> str | None:
    """The role the peer's verified certificate names, or None (no certificate)."""
    auth = context.auth_context() or {}
    names = list(auth.get("x509_common_name", ())) + list(
        auth.get("x509_subject_alternative_name", ())
    )
    for raw in names:
        name = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        if name.startswith(PREFIX):
            return name[len(PREFIX) :]
    return None


class RoleInterceptor(grpc.aio.ServerInterceptor):
    """Lets a WorkerLink call through only from a worker's certificate, a FrontendLink call only
    from a front-end's; the call is refused before the servicer reads a message."""

    def __init__(self, on_refused: Callable[[str, str | None], None] | None = None) -> None:
        self.on_refused = on_refused

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        needed = next((r for p, r in SERVICE_ROLES.items() if method.startswith(p)), None)
        if handler is None or needed is None:
            return handler
        return _checked(handler, needed, method, self.on_refused)


def _checked(handler, needed: str, method: str, on_refused) -> grpc.RpcMethodHandler:
    async def allowed(context) -> bool:
        role = peer_role(context)
        if role == needed:
            return True
        if on_refused is not None:
            on_refused(method, role)
        shown = f"a {role}'s certificate" if role else "no splitserve certificate"
        await context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{method} is for {needed}s; the peer showed {shown}",
        )
        return False

    kinds = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
    kind = next(k for k in kinds if getattr(handler, k) is not None)
    inner = getattr(handler, kind)
    if inspect.isasyncgenfunction(inner):

        async def behaviour(request_or_iterator, context):
            if await allowed(context):
                async for item in inner(request_or_iterator, context):
                    yield item

    else:

        async def behaviour(request_or_iterator, context):  # type: ignore[misc]
            if await allowed(context):
                return await inner(request_or_iterator, context)
            return None

    make = getattr(grpc, f"{kind}_rpc_method_handler")
    return make(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
