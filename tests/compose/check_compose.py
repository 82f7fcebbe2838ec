#!/usr/bin/env python3
"""End-to-end test of the containers: docker-compose.yml with a scheduler and scaled workers.

    python tests/compose/check_compose.py [--keep] [--base-image IMAGE] [--no-build]

Where a Docker engine is reachable: builds both images (from docker/wheelhouse/, filled first by
docker/wheelhouse.sh when empty, so the build needs no network), starts the system with 2
workers, sends greedy requests through the published client port, scales to 3 workers (the new
one must reuse the converted weights in the cache volume), stops one worker container while
requests run and checks that every request still finishes with the same tokens, then tears it
all down (containers, network, volume). Where no engine is reachable it says so and exits 0.

Not a pytest file on purpose (`pytest tests` never collects it): `make compose-test` runs it.
Needs the project's Python client (grpcio, protobuf), i.e. the project's virtual environment,
only once an engine has been found.
"""

from __future__ import annotations

import argparse
import os
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
WHEELHOUSE = ROOT / "docker" / "wheelhouse"
DEFAULT_BASE = "python:3.11-slim"
LOCAL_BASE = "localbase/python:3.11"
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
    cmd: list[str], *, env=None, timeout: float = 600, check: bool = True, capture: bool = True
) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(
            cmd,
            env=env,
            timeout=timeout,
            text=True,
            cwd=ROOT,
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
    """`docker compose` (v2) when present, else `docker-compose` (1.29+)."""
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
    if run(["docker", "pull", DEFAULT_BASE], check=False, timeout=300).returncode == 0:
        return DEFAULT_BASE
    if image_exists(LOCAL_BASE):
        say(f"{DEFAULT_BASE} cannot be pulled; using {LOCAL_BASE}")
        return LOCAL_BASE
    if shutil.which("debootstrap") and os.geteuid() == 0:
        say(f"{DEFAULT_BASE} cannot be pulled; building {LOCAL_BASE} with debootstrap")
        run([str(ROOT / "docker" / "build-base-image.sh"), LOCAL_BASE], timeout=1200)
        return LOCAL_BASE
    raise Failed(
        f"no base image: {DEFAULT_BASE} cannot be pulled and {LOCAL_BASE} does not "
        "exist (make base-image builds it; or set BASE_IMAGE)"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the system under test ---------------------------------------------------------------------


class System:
    def __init__(self, compose: list[str], project: str, env: dict[str, str]) -> None:
        self.compose = compose
        self.project = project
        self.env = env

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
        out = self.cmd("ps", "-q", service, timeout=60).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    def running_containers(self, service: str) -> list[str]:
        ids = self.containers(service)
        if not ids:
            return []
        fmt = "{{.Id}} {{.State.Running}}"
        out = run(["docker", "inspect", "-f", fmt, *ids], timeout=60).stdout
        return [line.split()[0] for line in out.splitlines() if line.endswith("true")]

    def wait_healthy(self, service: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        status = "?"
        while time.monotonic() < deadline:
            ids = self.containers(service)
            if ids:
                fmt = "{{.State.Status}} {{.State.Health.Status}}"
                status = run(
                    ["docker", "inspect", "-f", fmt, ids[0]], timeout=30, check=False
                ).stdout.strip()
                if status.endswith("healthy") and not status.endswith("unhealthy"):
                    return
                if status.startswith(("exited", "dead")):
                    break
            time.sleep(1)
        raise Failed(f"{service} not healthy after {timeout:g} s (state: {status})")

    def cache_listing(self) -> str:
        sched = self.running_containers("scheduler")[0]
        script = (
            "cd /cache && for d in models/* tokenizers/*; do "
            '[ -e "$d" ] && stat -c \'%n inode=%i mtime=%Y\' "$d"; done; true'
        )
        return run(["docker", "exec", sched, "sh", "-c", script], timeout=60).stdout.strip()

    def logs_tail(self, lines: int = 60) -> str:
        return self.cmd("logs", "--no-color", "--tail", str(lines), timeout=120, check=False).stdout


def container_of(worker_id: str, containers: list[str]) -> str | None:
    """A worker's id is `<hostname>-<pid>` and a container's hostname is its short id."""
    host = worker_id.rsplit("-", 1)[0]
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


def send_all(client, n: int, threads: int):
    with ThreadPoolExecutor(threads) as pool:
        return list(
            pool.map(lambda i: client.generate(PROMPTS[i % len(PROMPTS)], **PARAMS), range(n))
        )


def check_http(port: int) -> None:
    """GET /health on the published HTTP port."""
    url = f"http://127.0.0.1:{port}/health"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                say(f"HTTP {url} -> {reply.status} {reply.read(200).decode(errors='replace')}")
                return
        except (OSError, urllib.error.URLError) as exc:
            if time.monotonic() > deadline:
                raise Failed(f"HTTP {url} did not answer: {exc}") from exc
            time.sleep(1)


def scenario(system: System, port: int, http_port: int, workers: int) -> list[str]:
    sys.path.insert(0, str(ROOT))
    from common.client import SplitserveClient

    started = time.monotonic()
    system.cmd("up", "-d", "--scale", f"worker={workers}", timeout=600)
    system.wait_healthy("scheduler", timeout=180)
    say(f"scheduler healthy (grpc.health.v1) after {time.monotonic() - started:.1f} s")

    if http_port:
        check_http(http_port)
    client = SplitserveClient(f"127.0.0.1:{port}", timeout=300)
    try:
        info = client.wait_for_workers(workers, timeout=600)
        say(
            f"{len(info.workers)} workers attached after {time.monotonic() - started:.1f} s "
            f"(model {info.model})"
        )
        if len(info.workers) != workers:
            raise Failed(f"expected {workers} workers, {len(info.workers)} attached")

        t = time.monotonic()
        reference = {p: client.generate(p, **PARAMS) for p in PROMPTS}
        check_results(list(reference.values()), None, "reference requests")
        say(
            f"{len(PROMPTS)} sequential requests in {time.monotonic() - t:.1f} s; e.g. "
            f"{PROMPTS[0]!r} -> {reference[PROMPTS[0]].text[:40]!r}"
        )
        t = time.monotonic()
        results = send_all(client, 2 * len(PROMPTS), 2 * len(PROMPTS))
        check_results(results, reference, "concurrent requests")
        used = {w for r in results for w in r.worker_ids}
        say(
            f"{len(results)} concurrent requests in {time.monotonic() - t:.1f} s, same tokens as "
            f"sequential, served by {len(used)} workers"
        )

        cache_before = system.cache_listing()
        if "models/" not in cache_before:
            raise Failed(f"no converted model in the cache volume:\n{cache_before}")
        old = set(system.running_containers("worker"))
        t = time.monotonic()
        system.cmd("up", "-d", "--no-recreate", "--scale", f"worker={workers + 1}", timeout=600)
        info = client.wait_for_workers(workers + 1, timeout=600)
        new = set(system.running_containers("worker")) - old
        say(
            f"scaled to {len(info.workers)} workers; the new one attached in "
            f"{time.monotonic() - t:.1f} s"
        )
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

        victims = [under_load(system, client, reference, "stop")]
        victims.append(under_load(system, client, reference, "kill"))
        return victims
    finally:
        client.close()


def migrated_count(system: System) -> int:
    """Requests the scheduler moved off lost or drained workers, from its `worker_detached` logs."""
    logs = system.cmd("logs", "--no-color", "scheduler", timeout=120, check=False).stdout
    total = 0
    for line in logs.splitlines():
        if "worker_detached" in line:
            m = re.search(r"migrated[\"']?\s*[:=]\s*(\d+)", line)
            total += int(m.group(1)) if m else 0
    return total


def under_load(system: System, client, reference, how: str) -> str:
    """Send requests, then `docker stop` (how="stop") or `docker kill` (how="kill") the busiest
    worker while they run; every request must still finish with the reference tokens."""
    n = 4 * len(PROMPTS)
    results: list = []
    done = threading.Event()

    def load() -> None:
        try:
            results.extend(send_all(client, n, n))
        finally:
            done.set()

    migrated_before = migrated_count(system)
    t = time.monotonic()
    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    victim_id = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not done.is_set():
        busy = [w for w in client.server_info().workers if w.num_running > 0]
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
    say(f"{n} requests in flight; {verb} worker container {victim[:12]} ({victim_id})")
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
    loader.join(timeout=600)
    if loader.is_alive():
        raise Failed("requests still unfinished 600 s after the worker was stopped")
    if len(results) != n:
        raise Failed(f"only {len(results)} of {n} requests came back (see the error above)")
    check_results(results, reference, f"requests under worker loss ({how})")
    moved = sum(1 for r in results if len(r.worker_ids) > 1)
    migrated = migrated_count(system) - migrated_before
    say(
        f"all {n} requests finished in {time.monotonic() - t:.1f} s with the reference tokens; "
        f"the scheduler moved {migrated} to other workers, {moved} streamed from two workers"
    )

    remaining = len(system.running_containers("worker"))
    deadline = time.monotonic() + 60
    info = client.server_info()
    while len(info.workers) != remaining and time.monotonic() < deadline:
        time.sleep(0.5)
        info = client.server_info()
    say(f"scheduler lists {len(info.workers)} workers, {remaining} worker containers run")
    if len(info.workers) != remaining:
        raise Failed(f"the scheduler lists {len(info.workers)} workers but {remaining} run")
    return victim


def stop_and_check_exit_codes(system: System, skip: set[str]) -> None:
    ids = [c for c in system.containers("scheduler") + system.containers("worker") if c not in skip]
    system.cmd("stop", "-t", "20", timeout=300)
    codes = {}
    for cid in ids:
        out = run(["docker", "wait", cid], timeout=120, check=False).stdout.strip()
        name = run(["docker", "inspect", "-f", "{{.Name}}", cid], timeout=30).stdout.strip("/\n ")
        codes[name] = out
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


def build(system: System) -> None:
    for service in ("scheduler", "worker"):
        t = time.monotonic()
        system.cmd("build", service, timeout=3600)
        image = f"splitserve-{service}:{system.env.get('SPLITSERVE_IMAGE_TAG', 'latest')}"
        size = run(["docker", "image", "inspect", "-f", "{{.Size}}", image], timeout=30).stdout
        say(f"built {image} in {time.monotonic() - t:.0f} s, {int(size) / 1e6:.0f} MB")
    if (
        run(
            [
                "docker",
                "run",
                "--rm",
                "--entrypoint",
                "python",
                "splitserve-scheduler:" + system.env.get("SPLITSERVE_IMAGE_TAG", "latest"),
                "-c",
                "import torch",
            ],
            check=False,
            timeout=120,
        ).returncode
        == 0
    ):
        raise Failed("the scheduler image contains torch")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="workers to start with (then +1)")
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
    parser.add_argument("--no-http", action="store_true", help="skip the HTTP /health check")
    parser.add_argument("--keep", action="store_true", help="leave the system running at the end")
    args = parser.parse_args(argv)
    if args.workers < 2:
        parser.error("--workers must be at least 2 (one is stopped under load)")

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
    say(f"engine reachable; using `{' '.join(compose)}`")

    project = f"splitserve-ct{os.getpid()}"
    port, http_port = free_port(), free_port()
    env = dict(
        os.environ,
        SPLITSERVE_BIND_ADDRESS="127.0.0.1",
        SPLITSERVE_PUBLISHED_PORT=str(port),
        SPLITSERVE_HTTP_PUBLISHED_PORT=str(http_port),
    )
    system = System(compose, project, env)
    ok = False
    try:
        if not args.no_build:
            if not args.no_wheelhouse:
                ensure_wheelhouse()
            env["BASE_IMAGE"] = choose_base_image(args.base_image)
            say(f"building the images on {env['BASE_IMAGE']}")
            build(system)
        victims = scenario(system, port, 0 if args.no_http else http_port, args.workers)
        stop_and_check_exit_codes(system, skip=set(victims))
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
            say(f"left running: project {project}, client port 127.0.0.1:{port}")
        else:
            system.cmd("down", "-v", "--remove-orphans", "-t", "10", timeout=300, check=False)
            say("torn down (containers, network, volume)")
    if ok:
        say(f"compose test PASSED in {time.monotonic() - _t0:.0f} s")
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
