"""components/internal-tls: mutual TLS between schedulers, workers and front-ends.

Every TLS file a flag or a probe names lies in a read-only mount of the Secret
`splitserve-internal-tls`, under one of its keys; the server name workers, front-ends and probes
expect is the schedulers' Service name and a name docs/kubernetes.md tells the certificate to
carry; the schedulers serve the worker-link port with mutual TLS exactly when the clients dial
with a certificate (in every variant: either side alone locks the other out), and no kubelet
gRPC probe (no TLS) is left on it. The probe splitserve-health speaks mutual TLS, and the
openssl commands of docs/kubernetes.md make a certificate that is good as server and client.
"""

from __future__ import annotations

import importlib.util
import posixpath
import re
import shlex
import shutil
import subprocess
from concurrent import futures

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.tls import add_port
from tests.unit.deploy.rendering import (
    NAMESPACE,
    ROOT,
    VARIANTS,
    containers,
    env_of,
    named,
    rendered,
)

SECRET = "splitserve-internal-tls"
SECRET_KEYS = {"ca.crt", "tls.crt", "tls.key"}
TLS_VARIANTS = [v for v in VARIANTS if "internal-tls" in v]
DOCS = (ROOT / "docs" / "kubernetes.md").read_text()
PARTS = {
    "scheduler": ("StatefulSet", "splitserve-scheduler"),
    "worker": ("Deployment", "splitserve-worker"),
    "frontend": ("Deployment", "splitserve-frontend"),
}
# what each part's settings are called (SPLITSERVE_* of its config dataclass)
CLIENT_ENV = {
    "worker": "SPLITSERVE_TLS_",
    "frontend": "SPLITSERVE_SCHEDULER_TLS_",
}
SERVER_ENV = "SPLITSERVE_WORKER_TLS_"


def part(resources, name: str) -> tuple[dict, dict]:
    workload = named(resources, *PARTS[name])
    return workload, containers(workload)[0]


def env_values(container: dict, prefix: str) -> dict[str, str]:
    """{SUFFIX: value} of the variables named PREFIX + SUFFIX."""
    return {
        k[len(prefix) :]: e["value"]
        for k, e in env_of(container).items()
        if k.startswith(prefix) and "value" in e
    }


def probe_commands(container: dict) -> list[str]:
    commands = []
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = container.get(kind, {}).get("exec", {}).get("command")
        if command:
            commands.append(" ".join(command))
    return commands


def expand(text: str, container: dict) -> str:
    """$VAR and $(VAR) of the container's own variables, as the shell or the kubelet would."""
    values = {k: e.get("value", "") for k, e in env_of(container).items()}
    text = re.sub(r"\$\((\w+)\)", lambda m: values.get(m[1], m[0]), text)
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m[1], m[0]), text)


def probe_tls_args(container: dict) -> list[dict[str, str]]:
    """Each exec probe's --tls-* arguments (expanded), as {name: value}."""
    found = []
    for command in probe_commands(container):
        words = shlex.split(expand(command, container).replace("sh -c ", "", 1))
        args: dict[str, str] = {}
        for i, word in enumerate(words):
            if word.startswith("--tls"):
                name, eq, value = word.partition("=")
                args[name] = value if eq else words[i + 1]
        found.append(args)
    return found


def tls_mounts(workload: dict, container: dict) -> dict[str, set[str]]:
    """mountPath -> the keys of the internal-TLS Secret that appear there."""
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
    mounts = {}
    for mount in container.get("volumeMounts", []):
        secret = volumes[mount["name"]].get("secret", {})
        if secret.get("secretName") == SECRET:
            assert mount.get("readOnly") is True, mount
            keys = {i["path"] for i in secret["items"]} if "items" in secret else SECRET_KEYS
            mounts[mount["mountPath"]] = keys
    return mounts


def documented_sans() -> set[str]:
    """The DNS names docs/kubernetes.md's openssl command and cert-manager Certificate give."""
    (san_line,) = re.findall(r"subjectAltName = ([^'\n]+)", DOCS)
    openssl = {n.strip().removeprefix("DNS:") for n in san_line.split(",")}
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS, re.S)
    (certificate,) = [yaml.safe_load(b) for b in blocks if "kind: Certificate" in b]
    assert certificate["spec"]["secretName"] == SECRET
    assert {"server auth", "client auth"} <= set(certificate["spec"]["usages"])
    assert set(certificate["spec"]["dnsNames"]) == openssl
    return openssl


def client_tls(resources, name: str) -> dict[str, str]:
    return env_values(part(resources, name)[1], CLIENT_ENV[name])


@pytest.mark.parametrize("variant", TLS_VARIANTS)
def test_every_tls_file_is_in_a_mount_of_the_secret(variant):
    resources = rendered(variant)
    for name in PARTS:
        workload, container = part(resources, name)
        mounts = tls_mounts(workload, container)
        assert mounts, f"{name} does not mount the Secret {SECRET}"
        prefix = SERVER_ENV if name == "scheduler" else CLIENT_ENV[name]
        files = [v for k, v in env_values(container, prefix).items() if k.endswith("_FILE")]
        files += [v for args in probe_tls_args(container) for k, v in args.items() if "file" in k]
        assert len(files) >= 3, (name, files)
        for path in files:
            directory, key = posixpath.split(path)
            assert key in mounts.get(directory, set()), f"{name}: {path} is in no mount"
    # made outside the manifests (openssl or cert-manager), and docs/kubernetes.md says how
    assert SECRET not in {s["metadata"]["name"] for s in resources if s["kind"] == "Secret"}
    assert f"create secret generic {SECRET}" in DOCS and "--from-file=tls.key" in DOCS


@pytest.mark.parametrize("variant", TLS_VARIANTS)
def test_clients_expect_the_schedulers_service_name_which_the_certificate_carries(variant):
    resources = rendered(variant)
    sans = documented_sans()
    service = named(resources, "Service", "splitserve-scheduler")
    expected = f"{service['metadata']['name']}.{NAMESPACE}.svc"
    assert expected in sans
    names = [client_tls(resources, n)["SERVER_NAME"] for n in CLIENT_ENV]
    for name in PARTS:
        container = part(resources, name)[1]
        names += [a["--tls-server-name"] for a in probe_tls_args(container) if a]
    assert len(names) >= 5 and set(names) == {expected}, names


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_scheduler_serves_mutual_tls_exactly_when_its_clients_dial_with_a_certificate(
    variant,
):
    resources = rendered(variant)
    server = env_values(part(resources, "scheduler")[1], SERVER_ENV)
    serves_tls = bool(server.get("CERT_FILE"))
    if serves_tls:
        assert server.get("KEY_FILE"), "a certificate without its key"
    for name in CLIENT_ENV:
        tls = client_tls(resources, name)
        switch = env_of(part(resources, name)[1]).get(CLIENT_ENV[name].rstrip("_"), {})
        dials_tls = switch.get("value", "").lower() == "true" or bool(
            tls.get("CA_FILE") or tls.get("CERT_FILE")
        )
        assert dials_tls == serves_tls, (variant, name)
        # mutual: with --worker-tls-ca-file, a client without a certificate is refused
        if server.get("CA_FILE"):
            assert tls.get("CERT_FILE") and tls.get("KEY_FILE"), (variant, name)
        if dials_tls:
            assert tls.get("CA_FILE"), f"{name} would trust the system roots, not the CA"
            assert tls.get("SERVER_NAME"), f"{name} would expect the per-pod name"
    if "internal-tls" in variant:
        assert serves_tls and server.get("CA_FILE")


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_plaintext_probe_is_left_on_a_tls_port(variant):
    resources = rendered(variant)
    sched = part(resources, "scheduler")[1]
    serves_tls = bool(env_values(sched, SERVER_ENV).get("CERT_FILE"))
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = sched.get(kind, {})
        on_link = "grpc" in probe and probe["grpc"]["port"] in (50052, "worker-link")
        assert not (serves_tls and on_link), f"the kubelet's gRPC {kind} speaks no TLS"
        assert sum(k in probe for k in ("grpc", "httpGet", "tcpSocket", "exec")) <= 1, probe
    if serves_tls:
        for name in ("scheduler", "worker"):
            container = part(resources, name)[1]
            args = probe_tls_args(container)
            assert args and all(a.get("--tls-cert-file") for a in args), (name, args)
    worker = part(resources, "worker")[1]
    assert "--etcd-leader" in " ".join(probe_commands(worker))


# ---- the probe and the certificate, for real -------------------------------------------------


def healthcheck():
    spec = importlib.util.spec_from_file_location(
        "splitserve_health", ROOT / "docker/healthcheck.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serve_health(cert: str, key: str, ca: str) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("splitserve.v1.WorkerLink", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = add_port(server, "127.0.0.1:0", cert, key, ca)
    server.start()
    return server, port


def openssl_certificate(directory) -> dict[str, str]:
    """Runs the openssl commands of docs/kubernetes.md in `directory`."""
    blocks = re.findall(r"```sh\n(.*?)```", DOCS, re.S)
    (script,) = [b for b in blocks if "openssl req -x509" in b]
    subprocess.run(["bash", "-euc", script], cwd=directory, check=True, capture_output=True)
    return {k: str(directory / k) for k in SECRET_KEYS}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl")
def test_the_documented_certificate_serves_and_dials_under_the_expected_name(tmp_path):
    files = openssl_certificate(tmp_path)
    server, port = serve_health(files["tls.crt"], files["tls.key"], files["ca.crt"])
    check = healthcheck().check_grpc
    target = f"127.0.0.1:{port}"
    service = "splitserve.v1.WorkerLink"
    mutual = {
        "ca_file": files["ca.crt"],
        "cert_file": files["tls.crt"],
        "key_file": files["tls.key"],
        "server_name": f"splitserve-scheduler.{NAMESPACE}.svc",
    }
    try:
        # the same certificate as client (workers, front-ends, probes) and as server
        assert check(target, service, 3.0, mutual) == (True, "SERVING")
        ok, why = check(target, service, 1.0, {**mutual, "cert_file": "", "key_file": ""})
        assert not ok, "mutual TLS took a client without a certificate"
        assert not check(target, service, 1.0, {**mutual, "server_name": "elsewhere.svc"})[0]
        assert not check(target, service, 1.0, None)[0]  # plaintext
        assert not check(target, service, 1.0, {**mutual, "ca_file": str(tmp_path / "no")})[0]
    finally:
        server.stop(0)


def test_the_probe_command_line_takes_the_tls_flags(tmp_path, capsys):
    from tests.e2e.certs import CertAuthority

    ca = CertAuthority(tmp_path)
    cert, key = ca.issue("localhost", server=True)
    client_cert, client_key = ca.issue("probe", server=False)
    server, port = serve_health(cert, key, ca.cert_file)
    main = healthcheck().main
    base = [f"--target=127.0.0.1:{port}", "--service=splitserve.v1.WorkerLink", "--timeout=1"]
    tls = [f"--tls-ca-file={ca.cert_file}", "--tls-server-name=localhost"]
    try:
        assert (
            main([*base, *tls, f"--tls-cert-file={client_cert}", f"--tls-key-file={client_key}"])
            == 0
        )
        assert main([*base, *tls]) == 1
        assert main(base) == 1
        with pytest.raises(SystemExit):
            main([*base, *tls, f"--tls-cert-file={client_cert}"])
    finally:
        server.stop(0)
