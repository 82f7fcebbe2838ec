"""Groups of configuration fields, each declared once and shared by every service config that
has them (scheduler, front-end, worker).

A group is a dataclass made by `@config_group(heading)`: its fields carry the heading in their
metadata ("group"), under which `splitserve <command> --help` lists them
(common/settings.py). A service config composes groups as base classes and stays flat
(`cfg.tls_cert_file`, `cfg.max_model_len`), a slots=True dataclass:

    @dataclass(slots=True)
    class FrontendConfig(ClientEndpoint, ClientAccess, ModelSource, ServedModel, Logging): ...

Groups have empty `__slots__`, so several of them can be bases of one slotted class (dataclass
slots=True on each would make their layouts conflict). Where a group's help text does not fit
a role, the config names its own in a `FIELD_HELP` class variable (field name -> text).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, TypeVar

from common.event_loop import EVENT_LOOPS

T = TypeVar("T")

# headings of `--help`, in no particular order (each parser lists them as its fields come)
ENDPOINT = "endpoint and TLS"
CLUSTER = "cluster"
MODEL = "model"
LIMITS = "limits"
LOGGING = "logging"
RUNTIME = "runtime"


def opt(default: Any, help_text: str, **meta: Any) -> Any:
    """A config field: its default, its help text, and metadata (choices, flag, cli, group)."""
    return field(default=default, metadata={"help": help_text, **meta})


def config_group(heading: str) -> Callable[[type[T]], type[T]]:
    """Make a class a field group: a dataclass with empty __slots__ whose own fields are listed
    under `heading` (a field's own "group" metadata wins)."""

    def wrap(cls: type[T]) -> type[T]:
        namespace = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
        namespace["__slots__"] = ()
        group: Any = dataclass(type(cls)(cls.__name__, cls.__bases__, namespace))
        own = vars(group).get("__annotations__", {})
        for f in fields(group):
            if f.name in own and "group" not in f.metadata:
                f.metadata = MappingProxyType({**f.metadata, "group": heading})
        group.__config_heading__ = heading
        return group  # type: ignore[no-any-return]

    return wrap


@config_group(ENDPOINT)
class ClientEndpoint:
    """Where clients reach this process."""

    host: str = opt("0.0.0.0", "address to listen on")
    port: int = opt(50051, "client gRPC port (Generation API; front-ends on one host may share it)")
    http_port: int = opt(
        8000,
        "HTTP port (OpenAI API, /health, /cluster; the scheduler's also /metrics and the "
        "dashboard; front-ends on one host may share it); 0 = off",
    )
    advertise_host: str = opt(
        "",
        "host others reach this process at, as published in etcd and /cluster; default: "
        "--host, or this host's name or address when --host is 0.0.0.0",
    )


@config_group(ENDPOINT)
class ClientAccess:
    """Who may use the client APIs: TLS (optionally mutual) and an API key."""

    tls_cert_file: str = opt("", "PEM certificate: serve the client APIs (gRPC, HTTP) over TLS")
    tls_key_file: str = opt("", "PEM private key for --tls-cert-file")
    tls_client_ca_file: str = opt("", "require client certificates signed by this CA")
    api_key: str = opt(
        "", "key clients must send (HTTP 'Authorization: Bearer KEY', gRPC metadata); empty = none"
    )


@config_group(CLUSTER)
class Cluster:
    """How this process finds and trusts the others."""

    etcd: str = opt(
        "",
        "etcd HOST:PORT where the leader scheduler is elected: a scheduler runs there as leader "
        "or standby, a front-end or worker follows the leader named there (empty = one "
        "scheduler, no etcd)",
    )
    credentials: str = opt(
        "",
        "directory of this process's credentials (ca.crt, tls.crt, tls.key; `splitserve "
        "credentials DIR` makes a cluster's): mutual TLS on the internal links and to etcd. "
        "Required unless those links stay on loopback",
    )


@config_group(CLUSTER)
class LeaderAddress:
    """The scheduler a front-end or worker dials when no etcd names the leader."""

    scheduler: str = opt(
        "localhost:50052", "the scheduler's worker-link address HOST:PORT (without --etcd)"
    )


@config_group(MODEL)
class ModelSource:
    model: str | None = opt(
        None, "model: a HF directory, a .gguf file, or empty for the default SmolLM2-135M-Instruct"
    )


@config_group(MODEL)
class ServedModel:
    """The model as clients see it."""

    served_model_name: str | None = opt(None, "name clients use; default: the model's name")
    max_model_len: int = opt(
        4096,
        "longest prompt + output in tokens; the scheduler holds each worker to the smaller of "
        "this and the worker's own (its model's or --max-model-len)",
    )


@config_group(LIMITS)
class HttpLimits:
    """What one HTTP client may hold of the server: the scheduler's and the front-end's."""

    max_request_bytes: int = opt(
        4 * 1024 * 1024,
        "largest HTTP request body accepted; a larger one gets 413 before it is read (0 = no cap)",
    )
    http_header_timeout: float = opt(
        10.0, "seconds an HTTP connection has to send a complete request head (0 = no limit)"
    )
    http_max_connections: int = opt(
        1000,
        "most HTTP connections open at once (idle ones too); one more gets 503 and is closed. "
        "Keep it under the open-file limit (ulimit -n); 0 = no cap",
    )


@config_group(LIMITS)
class GrpcLimits:
    max_message_bytes: int = opt(4 * 1024 * 1024, "largest client gRPC message accepted")


@config_group(LOGGING)
class Logging:
    log_level: str = opt("info", "log level")
    log_json: bool = opt(True, "JSON log lines")


@config_group(RUNTIME)
class EventLoop:
    event_loop: str = opt(
        "auto", "asyncio loop: auto (uvloop when installed), uvloop, asyncio", choices=EVENT_LOOPS
    )
