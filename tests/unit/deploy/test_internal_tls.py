"""Closed by default: every internal link of the manifests is mutual TLS, a certificate per role.

Each pod mounts its own role's Secret `splitserve-<role>-tls`, read-only, at the directory its
process reads (`SPLITSERVE_CREDENTIALS`), and no other role's; both ends of every internal link
hold their roles' credentials; etcd serves clients and peers on mutual TLS only, its /health and
/metrics on loopback only; no kubelet probe is left on a TLS port. `splitserve credentials
--kubernetes-secrets` writes exactly the Secrets the pods mount, and the probes' command lines,
run for real with those credentials, get an answer only from a certificate of the cluster
(test_credential_secrets.py: the Secrets themselves).
"""

from __future__ import annotations

import fnmatch
import http.server
import importlib.util
import re
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.credentials import Credentials, role_name
from splitserve.k8s_secrets import secret_name
from tests.unit.deploy.credentials import (
    CREDENTIAL_SECRETS,
    MOUNT,
    PROBES,
    ROLE_OF,
    credential_mounts,
    credentials_dir,
    etcd_flags,
    flag_value,
    make_cluster,
    mounted,
    probe_commands,
)
from tests.unit.deploy.rendering import (
    ROOT,
    VARIANTS,
    component,
    containers,
    env_of,
    named,
    of_kind,
    rendered,
    volumes_of,
    workloads,
)

DOCS = (ROOT / "docs" / "kubernetes.md").read_text()
# (client, server, the server's port): every internal link
LINKS = [
    ("worker", "scheduler", "worker-link"),
    ("frontend", "scheduler", "worker-link"),
    ("scheduler", "etcd", "client"),
    ("worker", "etcd", "client"),
    ("frontend", "etcd", "client"),
    ("etcd-auth", "etcd", "client"),
    ("etcd", "etcd", "peer"),
]


def by_component(resources) -> dict[str, dict]:
    return {component(w): w for w in workloads(resources)}


# ---- the manifests --------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_pod_mounts_its_own_roles_credentials_and_no_other(variant):
    for w in workloads(rendered(variant)):
        role = ROLE_OF[component(w)]
        mounts = credential_mounts(w)
        assert mounts == {MOUNT: secret_name(role)}, (component(w), mounts)
        assert credentials_dir(w) == MOUNT
        (mount,) = [m for m in containers(w)[0]["volumeMounts"] if m["mountPath"] == MOUNT]
        assert mount.get("readOnly") is True
        secret = volumes_of(w)[mount["name"]]["secret"]
        assert "items" not in secret  # ca.crt, tls.crt and tls.key, as the Secret has them
        # the container's user (fsGroup 1000) reads it; nobody else
        assert secret["defaultMode"] & 0o777 in (0o400, 0o440), oct(secret["defaultMode"])
        pod = w["spec"]["template"]["spec"]["securityContext"]
        assert pod["runAsUser"] == pod["fsGroup"] == 1000 and pod["runAsNonRoot"] is True
        # one Secret of a role in the pod at all, whatever the container
        secrets = {v["secret"]["secretName"] for v in volumes_of(w).values() if "secret" in v}
        assert secrets & set(CREDENTIAL_SECRETS) == {secret_name(role)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_credentials_are_made_outside_the_manifests_and_documented(variant):
    resources = rendered(variant)
    assert not {s["metadata"]["name"] for s in of_kind(resources, "Secret")} & set(
        CREDENTIAL_SECRETS
    ), "a role's key in the manifests (and in git)"
    assert "--kubernetes-secrets" in DOCS
    for name in CREDENTIAL_SECRETS:
        assert name in DOCS
    text = yaml.safe_dump_all(resources)
    assert "worker-secret" not in text and "WORKER_SECRET" not in text


@pytest.mark.parametrize("variant", VARIANTS)
def test_both_ends_of_every_internal_link_hold_their_roles_credentials(variant):
    resources = rendered(variant)
    parts = by_component(resources)
    for client, server, _port in LINKS:
        if server not in parts:  # components/external-etcd: an etcd of your own (docs)
            assert server == "etcd" and "external-etcd" in variant
            continue
        for end in (client, server):
            mounts = credential_mounts(parts[end])
            assert mounts.get(credentials_dir(parts[end])) == secret_name(ROLE_OF[end]), end
    # the servers: the schedulers take their credentials for 50052 (mutual TLS, each link
    # only for its role: common/link_auth.py); etcd: test_etcd_serves_only_mutual_tls
    sched = containers(parts["scheduler"])[0]
    assert env_of(sched)["SPLITSERVE_CREDENTIALS"]["value"] == MOUNT
    ports = {p["name"]: p["containerPort"] for p in sched["ports"]}
    assert ports["worker-link"] == int(env_of(sched)["SPLITSERVE_WORKER_PORT"]["value"])


def test_etcd_serves_only_mutual_tls_and_health_on_loopback_only():
    resources = rendered("cpu")
    flags = etcd_flags(resources)
    for flag in ("--listen-client-urls", "--advertise-client-urls", "--listen-peer-urls"):
        assert all(v.startswith("https://") for v in flags[flag]), (flag, flags[flag])
    for url in flags["--initial-advertise-peer-urls"] + flags["--initial-cluster"][0].split(","):
        assert "https://" in url and "http://" not in url, url
    # a client or peer needs a certificate of the cluster's CA; peers only as etcd
    assert "--client-cert-auth" in flags and "--peer-client-cert-auth" in flags
    assert flags["--peer-cert-allowed-cn"] == [role_name("etcd")]
    for prefix in ("--", "--peer-"):
        assert flags[f"{prefix}trusted-ca-file"] == [f"{MOUNT}/ca.crt"]
        assert flags[f"{prefix}cert-file"] == [f"{MOUNT}/tls.crt"]
        assert flags[f"{prefix}key-file"] == [f"{MOUNT}/tls.key"]
    (metrics,) = flags["--listen-metrics-urls"]
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", metrics), metrics
    etcd = containers(named(resources, "StatefulSet", "splitserve-etcd"))[0]
    assert {p["name"] for p in etcd["ports"]} == {"client", "peer"}  # no plain port on the IP
    for command in probe_commands(etcd):
        assert command[0] == "splitserve-health"
        assert flag_value(command, "--http").startswith(metrics + "/"), command
    assert not any(k in etcd.get(p, {}) for p in PROBES for k in ("httpGet", "tcpSocket", "grpc"))


def test_every_certificate_name_a_part_dials_is_one_the_certificate_carries(tmp_path):
    """Workers and front-ends verify splitserve-scheduler and every part splitserve-etcd,
    whatever address they dial (common/link_auth.py, common/etcd_client.py); etcd's members
    dial each other at their per-pod peer names, which the etcd certificate must carry."""
    from cryptography import x509

    cluster = Path(make_cluster(tmp_path))
    cert = x509.load_pem_x509_certificate((cluster / "etcd" / "tls.crt").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = sans.get_values_for_type(x509.DNSName)
    flags = etcd_flags(rendered("cpu"))
    hosts = {
        re.match(r"(?:[\w-]+=)?https://([^:/]+)", url)[1]
        for url in flags["--initial-cluster"][0].split(",")
        + flags["--initial-advertise-peer-urls"]
        + flags["--advertise-client-urls"]
    }
    pod = "splitserve-etcd-1"
    for host in {h.replace("$POD_NAME", pod) for h in hosts}:
        assert any(fnmatch.fnmatch(host, n) for n in names), (host, names)
    assert role_name("etcd") in names


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_kubelet_probe_is_left_on_a_tls_port_and_exec_probes_show_the_pods_credentials(
    variant,
):
    parts = by_component(rendered(variant))
    tls_ports = {"scheduler": {50052, "worker-link"}, "etcd": {2379, 2380, "client", "peer"}}
    for name, ports in tls_ports.items():
        if name not in parts:
            continue
        c = containers(parts[name])[0]
        for kind in PROBES:
            probe = c.get(kind, {})
            for how in ("grpc", "httpGet", "tcpSocket"):
                assert probe.get(how, {}).get("port") not in ports, (name, kind)
    sched = containers(parts["scheduler"])[0]
    worker = containers(parts["worker"])[0]
    for c in (sched, worker):
        commands = probe_commands(c)
        assert commands
        for command in commands:
            assert flag_value(command, "--credentials") == MOUNT, command
    (liveness,) = probe_commands(worker)
    assert flag_value(liveness, "--etcd-leader") == "$SPLITSERVE_ETCD"  # the ConfigMap's
    assert "--no-stopped-process" in liveness


def test_the_auth_bootstrap_runs_once_as_a_job_with_the_root_credentials():
    resources = rendered("cpu")
    (job,) = of_kind(resources, "Job")
    c = containers(job)[0]
    assert c["command"] == ["python", "-m", "common.etcd_auth"]
    assert "--endpoint=$(SPLITSERVE_ETCD)" in c["args"]
    assert env_of(c)["SPLITSERVE_ETCD"]["valueFrom"]["configMapKeyRef"]["key"] == "etcd"
    assert credential_mounts(job) == {MOUNT: secret_name("root")}
    # nothing else holds the root role's key
    others = [w for w in workloads(resources) if w is not job]
    assert all(secret_name("root") not in credential_mounts(w).values() for w in others)
    # an etcd of your own: its auth is yours to turn on (docs/kubernetes.md)
    assert not of_kind(rendered("cpu+external-etcd"), "Job")


# ---- the probes, for real --------------------------------------------------------------------


def healthcheck():
    spec = importlib.util.spec_from_file_location(
        "splitserve_health", ROOT / "docker" / "healthcheck.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serve_health(credentials: Credentials) -> tuple[grpc.Server, int]:
    """grpc.health.v1 as the schedulers' 50052 serves it: mutual TLS, any cluster certificate."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("splitserve.v1.WorkerLink", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", credentials.server_credentials())
    server.start()
    return server, port


def test_the_schedulers_probe_answers_only_with_a_certificate_of_themake_cluster(made, tmp_path):
    cluster, _, secrets = made
    rogue = Path(make_cluster(tmp_path / "rogue"))
    server, port = serve_health(Credentials.load(cluster / "scheduler", "scheduler"))
    sched = containers(named(rendered("cpu"), "StatefulSet", "splitserve-scheduler"))[0]
    (command, _) = probe_commands(sched)
    main = healthcheck().main

    def probe(directory) -> int:
        args = [a for a in command[1:] if not a.startswith(("--target", "--credentials"))]
        given = [f"--credentials={directory}"] if directory else []
        return main([*args, f"--target=localhost:{port}", "--timeout=2", *given])

    try:
        # the pod's own Secret, as mounted; a worker's certificate may ask health too
        assert probe(mounted(secrets[secret_name("scheduler")], tmp_path / "mnt")) == 0
        assert probe(cluster / "worker") == 0
        assert probe(None) == 1  # plaintext: refused
        assert probe(rogue / "scheduler") == 1  # another CA's certificate: refused
    finally:
        server.stop(0)


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200
    body = b'{"health":"true","reason":""}'

    def do_GET(self):  # noqa: N802 - the handler's name
        self.send_response(self.status)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def test_the_etcd_probes_as_the_kubelet_runs_them(monkeypatch):
    etcd = containers(named(rendered("cpu"), "StatefulSet", "splitserve-etcd"))[0]
    readiness, liveness = probe_commands(etcd)
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    main = healthcheck().main

    def run(command) -> int:  # the same URL path, this test's port
        url = re.sub(r":\d+/", f":{port}/", flag_value(command, "--http"))
        return main([a if not a.startswith("--http") else f"--http={url}" for a in command[1:]])

    try:
        assert run(readiness) == 0 and run(liveness) == 0
        monkeypatch.setattr(_Health, "body", b'{"health":"false","reason":"NOSPACE"}')
        assert run(readiness) == 1  # no leader or an alarm: not ready
        monkeypatch.setattr(_Health, "status", 503)
        assert run(readiness) == 1
    finally:
        server.shutdown()
