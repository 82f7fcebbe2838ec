#!/usr/bin/env python3
"""End-to-end test of the containers: docker-compose.yml's HA topology (etcd, two schedulers,
front-ends, workers) with scaled front-ends and workers, every internal link on mutual TLS, and
the leader killed under load.

    python tests/compose/check_compose.py [--keep] [--base-image IMAGE] [--no-build]

Where a Docker engine is reachable:

1. builds both images the documented offline way: docker/wheelhouse.sh fills docker/wheelhouse/
   (skipped with --no-wheelhouse), a base image is found or made (python:3.11-slim, else
   localbase/python:3.11 from docker/build-base-image.sh), then docker/build-images.sh with
   WHEELHOUSE=0 (`make images`), whose builds install from the wheelhouse only;
2. starts the one-shot `credentials` service, etcd, both schedulers, 2 front-ends and 2 workers
   (`--scale frontend=2 --scale worker=2`), waits until every container is healthy, checks that
   the front-ends got distinct ports of the published ranges and that GET /cluster lists a
   leader and a standby;
   closed by default: `credentials` exited 0; each container mounts its own role's credentials
   volume only, read-only, its files mode 0600 and owned by the services' user, no CA key
   anywhere; a container with no credentials on the compose network gets nothing from either
   scheduler's port 50052 or etcd's 2379 (plaintext, or a certificate of another CA), nor
   etcd's loopback-only 2381; inside a worker and a front-end, their own certificates reach the
   leader key and grpc.health.v1 but not the other role's link nor any etcd write
   (tests/compose/access_probe.py);
3. sends greedy requests through both front-ends' published ports (reference tokens, then the
   same prompts concurrently: the same tokens);
4. scales to 3 workers (the new one must reuse the converted weights in the cache volume, and
   hold a certificate of the same CA: `up` runs `credentials` again, which keeps what is valid);
5. kills the leader scheduler's container (`docker kill`) while requests stream: the standby
   takes over and every request still finishes with the reference tokens; the killed container
   is started again and rejoins as the standby;
6. crashes the new leader's process inside its container (SIGKILL): the restart policy starts
   the container again, the first scheduler leads again, every request still finishes with the
   reference tokens;
7. stops (SIGTERM: drains) and kills a worker under load: every request still finishes;
8. stops everything (every container must exit 0 on SIGTERM) and tears it all down
   (containers, network, volumes).

Where no engine is reachable it says so and exits 0. Not a pytest file on purpose (`pytest
tests` never collects it): `make compose-test` runs it. Needs the project's Python client
(grpcio, protobuf), i.e. the project's virtual environment, only once an engine has been found.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILES = [ROOT / "docker-compose.yml", ROOT / "tests" / "compose" / "compose.test.yml"]
DEFAULT_BASE = "python:3.11-slim"
LOCAL_BASE = "localbase/python:3.11"
SCHEDULERS = ("scheduler-a", "scheduler-b")
PORT_RANGE = 10  # host ports per published range (front-ends at most)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Three things a scheduler in an LLM server does:",
    "Once upon a time",
]
PARAMS = dict(max_tokens=32, temperature=0.0, ignore_eos=True)
FINISHED_OK = {"stop", "length"}
STOP_GRACE_S = 60

_t0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[compose-test {time.monotonic() - _t0:6.1f}s] {msg}", flush=True)


class Failed(Exception):
    pass


def run(
    cmd: list[str],
    *,
    env=None,
    timeout: float = 600,
    check: bool = True,
    capture: bool = True,
    stdin: str | None = None,
) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(
            cmd,
            env=env,
            timeout=timeout,
            text=True,
            cwd=ROOT,
            input=stdin,
            stdout=subprocess.PIPE if capture else None,
            stderr=subprocess.STDOUT if capture else None,
        )
    except subprocess.TimeoutExpired as exc:
        raise Failed(f"timed out after {timeout:g} s: {' '.join(cmd)}") from exc
    if check and proc.returncode != 0:
        tail = "\n".join((proc.stdout or "").splitlines()[-40:])
        raise Failed(f"exit {proc.returncode}: {' '.join(cmd)}\n{tail}")
    return proc


# ---- finding an engine ---------------------------------------------------------------------


def engine_problem() -> str | None:
    """None when a Docker engine answers; else why not (fast: a few seconds at most)."""
    if shutil.which("docker") is None:
        return "no `docker` command on PATH"
    try:
        proc = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"],
            capture_output=True,
            text=True,
            timeout=15,
        )
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer within 15 s"
    if proc.returncode != 0 or not proc.stdout.strip():
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        reason = lines[-1].rstrip(".") if lines else f"exit {proc.returncode}"
        return f"the Docker engine is not reachable: {reason}"
    return None


def compose_command() -> list[str] | None:
    """`docker compose` (v2) when present, else `docker-compose` (1.29+); COMPOSE=... forces
    one (e.g. COMPOSE=docker-compose)."""
    forced = os.environ.get("COMPOSE", "").split()
    if forced:
        return forced
    try:
        if (
            subprocess.run(
                ["docker", "compose", "version"], capture_output=True, timeout=15
            ).returncode
            == 0
        ):
            return ["docker", "compose"]
    except subprocess.TimeoutExpired:
        pass
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def image_exists(name: str) -> bool:
    return run(["docker", "image", "inspect", name], check=False, timeout=30).returncode == 0


def choose_base_image(requested: str | None) -> str:
    if requested:
        if not image_exists(requested):
            say(f"pulling {requested}")
            run(["docker", "pull", requested], timeout=600)
        return requested
    if image_exists(DEFAULT_BASE):
        return DEFAULT_BASE
    if image_exists(LOCAL_BASE):
        say(f"{DEFAULT_BASE} is not here; using {LOCAL_BASE}")
        return LOCAL_BASE
    if run(["docker", "pull", DEFAULT_BASE], check=False, timeout=300).returncode == 0:
        return DEFAULT_BASE
    if shutil.which("debootstrap") and os.geteuid() == 0:
        say(f"{DEFAULT_BASE} cannot be pulled; building {LOCAL_BASE} with debootstrap")
        run([str(ROOT / "docker" / "build-base-image.sh"), LOCAL_BASE], timeout=1200)
        return LOCAL_BASE
    raise Failed(
        f"no base image: {DEFAULT_BASE} cannot be pulled and {LOCAL_BASE} does not "
        "exist (make base-image builds it; or set BASE_IMAGE)"
    )


def free_port_range(n: int) -> int:
    """The first of n consecutive ports free on 127.0.0.1."""
    rng = random.Random(os.getpid())
    for _ in range(200):
        base = rng.randrange(20000, 40000 - n)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise Failed(f"no {n} consecutive free ports on 127.0.0.1")


# ---- the system under test ---------------------------------------------------------------------


class System:
    def __init__(
        self, compose: list[str], project: str, env: dict[str, str], grpc_base: int, http_base: int
    ) -> None:
        self.compose = compose
        self.project = project
        self.env = env
        self.grpc_base = grpc_base  # the published ranges: PORT_RANGE ports from each
        self.http_base = http_base

    def cmd(self, *args: str, timeout: float = 600, check: bool = True, capture: bool = True):
        files = [a for f in COMPOSE_FILES for a in ("-f", str(f))]
        return run(
            [*self.compose, "-p", self.project, *files, *args],
            env=self.env,
            timeout=timeout,
            check=check,
            capture=capture,
        )

    def containers(self, service: str) -> list[str]:
        """Full ids of the service's containers, running or not, oldest first."""
        out = run(
            [
                "docker",
                "ps",
                "-a",
                "--no-trunc",
                "-q",
                "--filter",
                f"label=com.docker.compose.project={self.project}",
                "--filter",
                f"label=com.docker.compose.service={service}",
            ],
            timeout=60,
        ).stdout
        ids = [line.strip() for line in out.splitlines() if line.strip()]
        return list(reversed(ids))  # docker ps lists the newest first

    def inspect(self, cid: str, fmt: str) -> str:
        return run(["docker", "inspect", "-f", fmt, cid], timeout=30, check=False).stdout.strip()

    def running_containers(self, service: str) -> list[str]:
        return [
            c for c in self.containers(service) if self.inspect(c, "{{.State.Running}}") == "true"
        ]

    def wait_healthy(self, service: str, n: int, timeout: float) -> list[str]:
        """Waits until n containers of the service run and are healthy; returns them."""
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            ids = self.running_containers(service)
            fmt = "{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}"
            states = {c[:12]: self.inspect(c, fmt) for c in ids}
            healthy = [c for c in ids if states[c[:12]].endswith(" healthy")]
            if len(healthy) >= n:
                return healthy
            time.sleep(1)
        raise Failed(f"{service}: not {n} healthy containers after {timeout:g} s: {states}")

    def published_port(self, cid: str, container_port: int) -> int:
        ports = json.loads(self.inspect(cid, "{{json .NetworkSettings.Ports}}") or "{}")
        bindings = ports.get(f"{container_port}/tcp") or []
        if not bindings:
            raise Failed(f"container {cid[:12]} publishes no port for {container_port}")
        return int(bindings[0]["HostPort"])

    def cache_listing(self) -> str:
        frontend = self.running_containers("frontend")[0]
        script = (
            "cd /cache && for d in models/* tokenizers/*; do "
            '[ -e "$d" ] && stat -c \'%n inode=%i mtime=%Y\' "$d"; done; true'
        )
        return run(["docker", "exec", frontend, "sh", "-c", script], timeout=60).stdout.strip()

    def logs(self, *services: str, tail: int | None = None) -> str:
        args = ["logs", "--no-color"] + (["--tail", str(tail)] if tail else [])
        return self.cmd(*args, *services, timeout=120, check=False).stdout

    def logs_tail(self, lines: int = 15) -> str:
        """The last lines of each service's logs, without progress bars."""
        parts = []
        for service in ("credentials", "etcd", *SCHEDULERS, "frontend", "worker"):
            text = self.logs(service, tail=4 * lines)
            kept = [
                line
                for line in text.splitlines()
                if line.split("|", 1)[-1].strip() and not re.search(r"(it/s|s/it)\]", line)
            ]
            parts.append("\n".join(kept[-lines:]))
        return "\n".join(parts)


def http_json(url: str, timeout: float = 10) -> dict | None:
    """GET url as JSON; None on a non-2xx answer or no answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return json.loads(reply.read())
    except (OSError, urllib.error.URLError, ValueError):
        return None


class Cluster:
    """GET /cluster on a front-end's published HTTP port."""

    def __init__(self, http_port: int) -> None:
        self.url = f"http://127.0.0.1:{http_port}/cluster"

    def get(self) -> dict | None:
        return http_json(self.url)

    def leader(self) -> dict | None:
        body = self.get() or {}
        return next((s for s in body.get("schedulers", []) if s.get("role") == "leader"), None)

    def wait(self, what: str, predicate, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        body = None
        while time.monotonic() < deadline:
            body = self.get()
            if body is not None and predicate(body):
                return body
            time.sleep(0.5)
        raise Failed(f"/cluster: {what} not within {timeout:g} s; last: {json.dumps(body)[:600]}")


def roles(body: dict) -> list[str]:
    return sorted(s.get("role", "?") for s in body.get("schedulers", []))


def container_of(host_or_id: str, containers: list[str]) -> str | None:
    """A worker's or scheduler's id is `<hostname>-<pid>`; a container's hostname is its short
    id."""
    host = host_or_id.rsplit("-", 1)[0] if "-" in host_or_id else host_or_id
    for cid in containers:
        if host and cid.startswith(host):
            return cid
    return None


def check_results(results, reference, what: str) -> None:
    bad = [r for r in results if r.finish_reason not in FINISHED_OK or r.error]
    if bad:
        raise Failed(
            f"{what}: {len(bad)} of {len(results)} requests did not finish: "
            + "; ".join(f"{r.request_id}: {r.finish_reason} {r.error}" for r in bad[:5])
        )
    if reference is not None:
        diff = [
            (p, r) for p, r in results_by_prompt(results) if r.token_ids != reference[p].token_ids
        ]
        if diff:
            p, r = diff[0]
            raise Failed(
                f"{what}: {len(diff)} greedy outputs differ from the reference, e.g. "
                f"{p!r}: {r.text!r} (workers {r.worker_ids}) vs {reference[p].text!r}"
            )


def results_by_prompt(results):
    return [(PROMPTS[i % len(PROMPTS)], r) for i, r in enumerate(results)]


def send_all(clients, n: int, threads: int):
    """n requests, request i through clients[i % len(clients)] (each front-end in turn)."""
    with ThreadPoolExecutor(threads) as pool:
        return list(
            pool.map(
                lambda i: clients[i % len(clients)].generate(PROMPTS[i % len(PROMPTS)], **PARAMS),
                range(n),
            )
        )


def http_get(url: str, timeout: float = 10) -> tuple[int, dict | None]:
    """(status, JSON body) of a GET; (0, None) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read())
        except ValueError:
            return exc.code, None
    except (OSError, urllib.error.URLError, ValueError):
        return 0, None


def check_http(port: int) -> None:
    """GET /health (200) and /ready (200, or 503 before workers attach) on a front-end's
    published HTTP port."""
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        (health, body), (ready, ready_body) = http_get(url + "/health"), http_get(url + "/ready")
        if health == 200 and ready in (200, 503):
            status = (ready_body or {}).get("status")
            say(f"HTTP {url}: /health {health} {body}, /ready {ready} {status!r}")
            return
        if time.monotonic() > deadline:
            raise Failed(f"HTTP {url}: /health {health} {body}, /ready {ready} {ready_body}")
        time.sleep(1)


class Load:
    """n requests running in a thread, spread over the clients (the front-ends)."""

    def __init__(self, clients, n: int) -> None:
        self.n = n
        self.results: list = []
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(clients,), daemon=True)
        self.started = time.monotonic()
        self.thread.start()

    def _run(self, clients) -> None:
        try:
            self.results.extend(send_all(clients, self.n, self.n))
        except BaseException as exc:  # noqa: BLE001 - reported by finish()
            self.error = exc
        finally:
            self.done.set()

    def wait_streaming(self, client, timeout: float = 120) -> None:
        """Until some worker runs requests of this load (tokens are streaming)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.done.is_set():
            if any(w.num_running > 0 for w in client.server_info().workers):
                return
            time.sleep(0.05)
        raise Failed("no worker was seen running requests; cannot disturb the system under load")

    def finish(self, reference, what: str, timeout: float = 600) -> float:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise Failed(f"{what}: requests still unfinished after {timeout:g} s")
        if self.error is not None:
            raise Failed(f"{what}: {type(self.error).__name__}: {self.error}")
        if len(self.results) != self.n:
            raise Failed(f"{what}: only {len(self.results)} of {self.n} requests came back")
        check_results(self.results, reference, what)
        return time.monotonic() - self.started


def scenario(system: System, workers: int, frontends: int) -> tuple[list[str], dict]:
    sys.path.insert(0, str(ROOT))
    from common.client import SplitserveClient

    notes: dict = {}
    started = time.monotonic()
    system.cmd(
        "up", "-d", "--no-build", "--scale", f"worker={workers}",
        "--scale", f"frontend={frontends}", timeout=600,
    )  # fmt: skip
    system.wait_healthy("etcd", 1, timeout=120)
    for service in SCHEDULERS:
        system.wait_healthy(service, 1, timeout=180)
    fe_ids = system.wait_healthy("frontend", frontends, timeout=180)
    say(
        f"etcd, {len(SCHEDULERS)} schedulers and {frontends} front-ends healthy after "
        f"{time.monotonic() - started:.1f} s"
    )
    ports = [(system.published_port(c, 50051), system.published_port(c, 8000)) for c in fe_ids]
    grpc_ports = sorted(p for p, _ in ports)
    base, http_base = system.grpc_base, system.http_base
    say(f"front-ends published on client ports {grpc_ports}, HTTP {sorted(h for _, h in ports)}")
    if len(set(grpc_ports)) != frontends or not all(
        base <= p < base + PORT_RANGE and http_base <= h < http_base + PORT_RANGE for p, h in ports
    ):
        raise Failed(f"front-ends' ports not distinct or outside the published ranges: {ports}")
    for _, http in ports:
        check_http(http)
    check_credentials(system)

    cluster = Cluster(ports[0][1])
    body = cluster.wait(
        f"a leader, a standby, {frontends} front-ends and {workers} workers",
        lambda b: (
            roles(b) == ["leader", "standby"]
            and len(b["frontends"]) == frontends
            and len(b["workers"]) == workers
        ),
        timeout=600,
    )
    say(
        f"/cluster after {time.monotonic() - started:.1f} s: schedulers {roles(body)} "
        f"(epoch {body['epoch']}), {len(body['frontends'])} front-ends, "
        f"{len(body['workers'])} workers, model {body['model']}"
    )
    notes["startup_s"] = time.monotonic() - started
    check_access(system)

    clients = [SplitserveClient(f"127.0.0.1:{p}", timeout=300) for p, _ in ports]
    try:
        info = clients[0].wait_for_workers(workers, timeout=300)
        if len(info.workers) != workers:
            raise Failed(f"expected {workers} workers, {len(info.workers)} attached")

        t = time.monotonic()
        reference = {p: clients[0].generate(p, **PARAMS) for p in PROMPTS}
        check_results(list(reference.values()), None, "reference requests")
        say(
            f"{len(PROMPTS)} sequential requests in {time.monotonic() - t:.1f} s; e.g. "
            f"{PROMPTS[0]!r} -> {reference[PROMPTS[0]].text[:40]!r}"
        )
        t = time.monotonic()
        results = send_all(clients, 2 * len(PROMPTS), 2 * len(PROMPTS))
        check_results(results, reference, "concurrent requests")
        used = {w for r in results for w in r.worker_ids}
        say(
            f"{len(results)} concurrent requests through {len(clients)} front-ends in "
            f"{time.monotonic() - t:.1f} s, same tokens as sequential, served by {len(used)} "
            "workers"
        )

        scale_workers(system, clients[0], workers + 1, frontends)
        check_credentials(system)  # the new worker's, after `credentials` ran again
        notes["failover_kill"] = failover(system, cluster, clients, reference, "kill")
        notes["failover_crash"] = failover(system, cluster, clients, reference, "crash")
        victims = [worker_under_load(system, clients, reference, "stop")]
        victims.append(worker_under_load(system, clients, reference, "kill"))
        return victims, notes
    finally:
        for client in clients:
            client.close()


# which credentials volumes each service mounts (mount point -> volume), all read-only
CREDENTIAL_MOUNTS = {
    "etcd": {
        "/etc/splitserve/credentials": "credentials-etcd",
        "/etc/splitserve/root-credentials": "credentials-root",
    },
    **{s: {"/etc/splitserve/credentials": "credentials-scheduler"} for s in SCHEDULERS},
    "frontend": {"/etc/splitserve/credentials": "credentials-frontend"},
    "worker": {"/etc/splitserve/credentials": "credentials-worker"},
}
LIST_FILES = (
    "import os, pathlib, json\n"
    "print(json.dumps({str(p): [oct(p.stat().st_mode & 0o777), p.stat().st_uid] "
    "for p in pathlib.Path('/etc/splitserve').rglob('*') if p.is_file()}))"
)


def check_credentials(system: System) -> None:
    """The one-shot service made the credentials; each container holds its role's only."""
    (made,) = system.containers("credentials")
    code = system.inspect(made, "{{.State.ExitCode}}")
    if system.inspect(made, "{{.State.Status}}") != "exited" or code != "0":
        raise Failed(
            f"the credentials service did not exit 0: {code}\n{system.logs('credentials')}"
        )
    prefix = f"{system.project}_"
    cas = set()
    for service, expected in CREDENTIAL_MOUNTS.items():
        for cid in system.running_containers(service):
            mounts = json.loads(system.inspect(cid, "{{json .Mounts}}") or "[]")
            held = {
                m["Destination"]: (m.get("Name", "").removeprefix(prefix), m["RW"])
                for m in mounts
                if m["Destination"].startswith("/etc/splitserve")
            }
            if held != {path: (volume, False) for path, volume in expected.items()}:
                raise Failed(f"{service} {cid[:12]} mounts {held}, expected {expected} read-only")
            files = json.loads(
                run(["docker", "exec", cid, "python", "-c", LIST_FILES], timeout=60).stdout
            )
            names = {os.path.basename(f) for f in files}
            bad = {f: m for f, m in files.items() if m != ["0o600", 1000]}
            if bad or "ca.key" in names or not {"ca.crt", "tls.crt", "tls.key"} <= names:
                raise Failed(f"{service} {cid[:12]}: credentials files {files}")
            ca = ["cat", "/etc/splitserve/credentials/ca.crt"]
            cas.add(run(["docker", "exec", cid, *ca], timeout=60).stdout)
    if len(cas) != 1:  # `up` runs `credentials` again: it must keep the cluster's CA
        raise Failed(f"the containers trust {len(cas)} different CAs")
    say(
        "credentials: each container mounts its own role's volume read-only (etcd also root's), "
        "files 0600 owned by uid 1000, one CA, no CA key outside the credentials service"
    )


def access_probe(system: System, cmd: list[str], what: str) -> None:
    """Runs tests/compose/access_probe.py with `cmd` (a `docker run` or `docker exec` ending in
    `python -` and its arguments); every check must come out as expected."""
    script = (ROOT / "tests" / "compose" / "access_probe.py").read_text()
    out = run(cmd, stdin=script, timeout=300).stdout.strip().splitlines()
    results = json.loads(out[-1])
    wrong = {k: v["got"] for k, v in results.items() if not v["got"].startswith(v["expect"])}
    if wrong or not results:
        raise Failed(f"{what}: " + "; ".join(f"{k}: {v}" for k, v in wrong.items()))
    refused = sum(v["expect"].startswith("refused") for v in results.values())
    say(f"{what}: {refused} attempts refused, {len(results) - refused} answered, as expected")


def check_access(system: System) -> None:
    """Nothing for a process without the cluster's credentials; a role only its own links."""
    etcd = system.running_containers("etcd")[0]
    networks = json.loads(system.inspect(etcd, "{{json .NetworkSettings.Networks}}"))
    (network,) = networks
    image = f"splitserve-scheduler:{system.env.get('SPLITSERVE_IMAGE_TAG', 'latest')}"
    outsider = ["docker", "run", "--rm", "-i", "--network", network, "--entrypoint", "python"]
    # the CA's certificate is no secret: an impostor may trust it and still get nothing
    ca = run(["docker", "exec", etcd, "cat", "/etc/splitserve/credentials/ca.crt"], timeout=60)
    known = base64.b64encode(ca.stdout.encode()).decode()
    access_probe(
        system, [*outsider, image, "-", "outsider", known], "no credentials, on the network"
    )
    for role in ("worker", "frontend"):
        cid = system.running_containers(role)[0]
        exec_in = ["docker", "exec", "-i", cid, "python", "-"]
        access_probe(system, [*exec_in, role, "/etc/splitserve/credentials"], f"inside a {role}")


def scale_workers(system: System, client, n: int, frontends: int) -> None:
    cache_before = system.cache_listing()
    if "models/" not in cache_before:
        raise Failed(f"no converted model in the cache volume:\n{cache_before}")
    old = set(system.running_containers("worker"))
    t = time.monotonic()
    system.cmd(
        "up", "-d", "--no-build", "--no-recreate", "--scale", f"worker={n}",
        "--scale", f"frontend={frontends}", timeout=600,
    )  # fmt: skip
    info = client.wait_for_workers(n, timeout=600)
    new = set(system.running_containers("worker")) - old
    took = time.monotonic() - t
    say(f"scaled to {len(info.workers)} workers; the new one attached in {took:.1f} s")
    if len(new) != 1:
        raise Failed(f"expected one new worker container, got {len(new)}")
    new_logs = run(["docker", "logs", next(iter(new))], timeout=60).stdout
    cache_after = system.cache_listing()
    if cache_after != cache_before or "de-quantizing" in new_logs:
        raise Failed(
            "the new worker converted the weights again instead of using the cache "
            f"volume:\nbefore:\n{cache_before}\nafter:\n{cache_after}"
        )
    say("the new worker reused the converted weights from the cache volume")


def scheduler_containers(system: System) -> dict[str, str]:
    """container id -> service, for both schedulers' containers."""
    return {c: s for s in SCHEDULERS for c in system.containers(s)}


def crash_process(cid: str, name: str) -> None:
    """SIGKILL the splitserve process in a container (not its init): a crash, which the restart
    policy answers, unlike `docker kill`."""
    script = (
        "import os\n"
        "me = os.getpid()\n"
        "for p in filter(str.isdigit, os.listdir('/proc')):\n"
        "    if int(p) in (1, me):\n"
        "        continue\n"
        "    try:\n"
        "        cmd = open(f'/proc/{p}/cmdline', 'rb').read()\n"
        "    except OSError:\n"
        "        continue\n"
        f"    if b'splitserve' in cmd and b'{name}' in cmd:\n"
        "        os.kill(int(p), 9)\n"
        "        print(p)\n"
    )
    out = run(["docker", "exec", cid, "python", "-c", script], timeout=60).stdout.split()
    if not out:
        raise Failed(f"no splitserve {name} process found in {cid[:12]}")


def failover(system: System, cluster: Cluster, clients, reference, how: str) -> dict:
    """Kill the leader scheduler while requests stream ("kill": `docker kill` its container,
    then `docker start` it; "crash": SIGKILL its process, the restart policy starts it again);
    every request must finish with the reference tokens, the other scheduler must lead with a
    newer epoch, and the killed one must come back as the standby."""
    before = cluster.get() or {}
    old = cluster.leader()
    if old is None:
        raise Failed("no leader in /cluster before the failover")
    containers = scheduler_containers(system)
    victim = container_of(old["host"], list(containers))
    if victim is None:
        raise Failed(f"leader {old} matches no scheduler container of {list(containers)}")
    restarts_before = int(system.inspect(victim, "{{.RestartCount}}") or 0)

    load = Load(clients, 4 * len(PROMPTS))
    load.wait_streaming(clients[0])
    verb = {"kill": "docker kill of", "crash": "SIGKILL of the scheduler process in"}[how]
    say(
        f"{load.n} requests streaming; {verb} the leader's container "
        f"{containers[victim]} {victim[:12]} (epoch {old['epoch']})"
    )
    t_kill = time.monotonic()
    if how == "kill":
        run(["docker", "kill", victim], timeout=60)
    else:
        crash_process(victim, "scheduler")
    body = cluster.wait(
        "a new leader",
        lambda b: any(
            s.get("role") == "leader" and s.get("epoch", 0) > old["epoch"]
            for s in b.get("schedulers", [])
        ),
        timeout=60,
    )
    takeover_s = time.monotonic() - t_kill
    new = next(s for s in body["schedulers"] if s["role"] == "leader")
    new_container = container_of(new["host"], list(containers))
    if new_container is None or (how == "kill" and new_container == victim):
        raise Failed(f"the new leader {new} is not the other scheduler's container")
    elapsed = load.finish(reference, f"requests under leader loss ({how})")
    last = (cluster.get() or body).get("last_takeover", {})
    who = containers[new_container] + (" (restarted)" if new_container == victim else "")
    say(
        f"{who} leads (epoch {new['epoch']}) {takeover_s:.1f} s after the kill (outage "
        f"{last.get('seconds')} s: resumed {last.get('resumed')}, adopted {last.get('adopted')}, "
        f"recomputed {last.get('recomputed_tokens')} tokens); all {load.n} requests finished "
        f"in {elapsed:.1f} s with the reference tokens"
    )

    t = time.monotonic()
    if how == "kill":
        # `docker kill` counts as stopped by hand: no restart policy brings it back
        time.sleep(2)
        state = system.inspect(victim, "{{.State.Status}}")
        if state == "running":
            raise Failed("a container stopped by `docker kill` came back by itself")
        run(["docker", "start", victim], timeout=60)
        how_back = "started again by `docker start`"
    else:
        deadline = time.monotonic() + 60
        while int(system.inspect(victim, "{{.RestartCount}}") or 0) <= restarts_before:
            if time.monotonic() > deadline:
                raise Failed(f"the crashed scheduler {victim[:12]} was not restarted")
            time.sleep(0.5)
        how_back = "restarted by its restart policy"
    system.wait_healthy(containers[victim], 1, timeout=180)
    body = cluster.wait(
        "the killed scheduler back (a leader and a standby)",
        lambda b: roles(b) == ["leader", "standby"],
        timeout=120,
    )
    leader = next(s for s in body["schedulers"] if s["role"] == "leader")
    leads = containers.get(container_of(leader["host"], list(containers)) or "", "?")
    say(
        f"{containers[victim]} {how_back}, healthy after {time.monotonic() - t:.1f} s; "
        f"{leads} leads, the other stands by; failovers so far: {body.get('failovers')}, "
        f"epoch {before.get('epoch')} -> {body.get('epoch')}"
    )
    return {"takeover_s": takeover_s, "requests_s": elapsed}


def migrated_count(system: System) -> int:
    """Requests the leader moved off lost or drained workers, from `worker_detached` logs."""
    logs = system.logs(*SCHEDULERS)
    total = 0
    for line in logs.splitlines():
        if "worker_detached" in line:
            m = re.search(r"migrated[\"']?\s*[:=]\s*(\d+)", line)
            total += int(m.group(1)) if m else 0
    return total


def worker_under_load(system: System, clients, reference, how: str) -> str:
    """`docker stop` (how="stop") or `docker kill` (how="kill") the busiest worker while
    requests run; every request must still finish with the reference tokens."""
    migrated_before = migrated_count(system)
    load = Load(clients, 4 * len(PROMPTS))
    victim_id = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not load.done.is_set():
        busy = [w for w in clients[0].server_info().workers if w.num_running > 0]
        if busy:
            victim_id = max(busy, key=lambda w: w.num_running).worker_id
            break
        time.sleep(0.05)
    if victim_id is None:
        raise Failed("no worker was seen running requests; cannot stop one under load")
    containers = system.running_containers("worker")
    victim = container_of(victim_id, containers)
    if victim is None:
        raise Failed(f"worker {victim_id} matches no container of {containers}")
    verb = {"stop": "stopping (SIGTERM)", "kill": "killing (SIGKILL)"}[how]
    say(f"{load.n} requests in flight; {verb} worker container {victim[:12]} ({victim_id})")
    stop_started = time.monotonic()
    if how == "stop":
        # longer than the worker's drain (--drain-timeout, 30 s): it finishes, then exits
        run(["docker", "stop", "-t", str(STOP_GRACE_S), victim], timeout=STOP_GRACE_S + 60)
    else:
        run(["docker", "kill", victim], timeout=60)
    code = run(["docker", "wait", victim], timeout=60).stdout.strip()
    say(f"worker container gone after {time.monotonic() - stop_started:.1f} s, exit code {code}")
    if how == "stop" and code != "0":
        raise Failed(
            f"the worker stopped under load exited {code}, not 0 (137: it still ran "
            f"{STOP_GRACE_S} s after SIGTERM and was killed)"
        )
    elapsed = load.finish(reference, f"requests under worker loss ({how})")
    moved = sum(1 for r in load.results if len(r.worker_ids) > 1)
    migrated = migrated_count(system) - migrated_before
    say(
        f"all {load.n} requests finished in {elapsed:.1f} s with the reference tokens; "
        f"the leader moved {migrated} to other workers, {moved} streamed from two workers"
    )

    remaining = len(system.running_containers("worker"))
    deadline = time.monotonic() + 60
    info = clients[0].server_info()
    while len(info.workers) != remaining and time.monotonic() < deadline:
        time.sleep(0.5)
        info = clients[0].server_info()
    say(f"the leader lists {len(info.workers)} workers, {remaining} worker containers run")
    if len(info.workers) != remaining:
        raise Failed(f"the leader lists {len(info.workers)} workers but {remaining} run")
    return victim


def stop_and_check_exit_codes(system: System, skip: set[str]) -> None:
    services = ("etcd", *SCHEDULERS, "frontend", "worker")
    ids = [c for s in services for c in system.running_containers(s) if c not in skip]
    system.cmd("stop", "-t", "20", timeout=300)
    codes = {}
    for cid in ids:
        out = run(["docker", "wait", cid], timeout=120, check=False).stdout.strip()
        codes[system.inspect(cid, "{{.Name}}").strip("/")] = out
    say("exit codes after `stop`: " + ", ".join(f"{k}={v}" for k, v in sorted(codes.items())))
    bad = {k: v for k, v in codes.items() if v != "0"}
    if bad:
        raise Failed(f"containers did not exit cleanly on SIGTERM: {bad}")


# ---- main ------------------------------------------------------------------------------------


def ensure_wheelhouse() -> None:
    """Bring docker/wheelhouse/ up to date with pyproject.toml (quick when it already is)."""
    t = time.monotonic()
    out = run([str(ROOT / "docker" / "wheelhouse.sh")], timeout=1800).stdout
    last = out.strip().splitlines()[-1] if out.strip() else ""
    say(f"{last} (docker/wheelhouse.sh, {time.monotonic() - t:.0f} s)")


def build(env: dict[str, str]) -> None:
    """docker/build-images.sh (`make images`) without refreshing the wheelhouse again."""
    t = time.monotonic()
    out = run(
        [str(ROOT / "docker" / "build-images.sh")],
        env=dict(env, WHEELHOUSE="0"),
        timeout=3600,
    ).stdout
    tag = env.get("SPLITSERVE_IMAGE_TAG", "latest")
    for line in out.splitlines():
        if re.match(r"splitserve-\w+:\S+ built in", line):
            say(line)
    for service in ("scheduler", "worker"):
        image = f"splitserve-{service}:{tag}"
        size = run(["docker", "image", "inspect", "-f", "{{.Size}}", image], timeout=30).stdout
        say(f"{image}: {int(size) / 1e6:.0f} MB")
    say(f"images built in {time.monotonic() - t:.0f} s")
    probe = ["docker", "run", "--rm", "--entrypoint", "python", f"splitserve-scheduler:{tag}"]
    if run([*probe, "-c", "import torch"], check=False, timeout=120).returncode == 0:
        raise Failed("the scheduler image contains torch")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="workers to start with (then +1)")
    parser.add_argument("--frontends", type=int, default=2, help="front-ends to start")
    parser.add_argument(
        "--base-image",
        default=os.environ.get("BASE_IMAGE") or None,
        help=f"base of both images (default {DEFAULT_BASE}, else {LOCAL_BASE})",
    )
    parser.add_argument("--no-build", action="store_true", help="use the images already built")
    parser.add_argument(
        "--no-wheelhouse",
        action="store_true",
        help="do not refresh docker/wheelhouse/ (the build installs from it "
        "when it holds wheels, else from PyPI)",
    )
    parser.add_argument("--keep", action="store_true", help="leave the system running at the end")
    args = parser.parse_args(argv)
    if args.workers < 2:
        parser.error("--workers must be at least 2 (one is stopped under load)")
    if not 1 <= args.frontends <= PORT_RANGE:
        parser.error(f"--frontends must be 1 to {PORT_RANGE}")

    problem = engine_problem()
    if problem is not None:
        print(f"compose test SKIPPED: {problem}. Start a Docker engine to run it.", flush=True)
        return 0
    compose = compose_command()
    if compose is None:
        print(
            "compose test SKIPPED: neither `docker compose` nor `docker-compose` is installed.",
            flush=True,
        )
        return 0
    version = run([*compose, "version"], check=False, timeout=30).stdout.strip().splitlines()
    say(f"engine reachable; using `{' '.join(compose)}` ({version[0] if version else '?'})")

    project = f"splitserve-ct{os.getpid()}"
    grpc_base = free_port_range(2 * PORT_RANGE)  # client gRPC ports, then HTTP ports
    http_base = grpc_base + PORT_RANGE
    env = dict(
        os.environ,
        SPLITSERVE_BIND_ADDRESS="127.0.0.1",
        SPLITSERVE_PUBLISHED_PORT=f"{grpc_base}-{grpc_base + PORT_RANGE - 1}",
        SPLITSERVE_HTTP_PUBLISHED_PORT=f"{http_base}-{http_base + PORT_RANGE - 1}",
    )
    system = System(compose, project, env, grpc_base, http_base)
    ok = False
    try:
        if not args.no_build:
            if not args.no_wheelhouse:
                ensure_wheelhouse()
            env["BASE_IMAGE"] = choose_base_image(args.base_image)
            say(f"building the images on {env['BASE_IMAGE']}")
            build(env)
        victims, notes = scenario(system, args.workers, args.frontends)
        stop_and_check_exit_codes(system, skip=set(victims))
        say(
            "summary: startup {startup_s:.0f} s; leader docker-killed: new leader after "
            "{kill[takeover_s]:.1f} s; leader process crashed: new leader after "
            "{crash[takeover_s]:.1f} s".format(
                startup_s=notes["startup_s"],
                kill=notes["failover_kill"],
                crash=notes["failover_crash"],
            )
        )
        ok = True
    except Exception as exc:  # noqa: BLE001 - report any failure, then tear down
        print(f"\ncompose test FAILED: {type(exc).__name__}: {exc}", flush=True)
        try:
            print("---- last log lines ----\n" + system.logs_tail(), flush=True)
        except Failed:
            pass
    except KeyboardInterrupt:
        print("\ncompose test interrupted", flush=True)
    finally:
        if args.keep:
            say(
                f"left running: project {project}, client ports {env['SPLITSERVE_PUBLISHED_PORT']}"
                f", HTTP {env['SPLITSERVE_HTTP_PUBLISHED_PORT']}"
            )
        else:
            system.cmd("down", "-v", "--remove-orphans", "-t", "10", timeout=300, check=False)
            say("torn down (containers, network, volumes)")
    if ok:
        say(f"compose test PASSED in {time.monotonic() - _t0:.0f} s")
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
