"""The Secrets `splitserve credentials --kubernetes-secrets` writes are the ones the pods mount,
and the cert-manager Certificates docs/kubernetes.md shows ask for the same certificates."""

from __future__ import annotations

import base64
import re
import stat

import kubernetes_validate
import pytest
import yaml

from common.credentials import ETCD_EXTRA_NAMES, Credentials, certificate_role, role_name
from splitserve.k8s_secrets import secret_name
from tests.unit.deploy.credentials import (
    CREDENTIAL_SECRETS,
    KEYS,
    ROLE_OF,
    credential_mounts,
    make_cluster,
    mounted,
)
from tests.unit.deploy.rendering import NAMESPACE, ROOT, component, rendered, workloads

DOCS = (ROOT / "docs" / "kubernetes.md").read_text()


# ---- the Secrets `splitserve credentials --kubernetes-secrets` writes -----------------------


def test_the_secrets_file_holds_exactly_what_the_pods_mount(made):
    cluster, path, secrets = made
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    mounted_names = {s for w in workloads(rendered("cpu")) for s in credential_mounts(w).values()}
    assert set(secrets) == mounted_names == set(CREDENTIAL_SECRETS)
    for name, secret in secrets.items():
        role = CREDENTIAL_SECRETS[name]
        assert secret["type"] == "kubernetes.io/tls"
        assert secret["metadata"]["namespace"] == NAMESPACE
        assert set(secret["data"]) == KEYS  # never the CA's key
        data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
        assert data["tls.crt"] == (cluster / role / "tls.crt").read_bytes()
        assert data["ca.crt"] == (cluster / "ca" / "ca.crt").read_bytes()
        assert certificate_role(data["tls.crt"]) == role
    assert (cluster / "ca" / "ca.key").read_bytes() not in path.read_bytes()


@pytest.mark.parametrize("version", [kubernetes_validate.latest_version()])
def test_the_secrets_are_valid_objects(made, version):
    for secret in made[2].values():
        kubernetes_validate.validate(secret, version, strict=True)


def test_each_pod_loads_the_secret_it_mounts_as_its_own_role(made, tmp_path):
    secrets = made[2]
    for w in workloads(rendered("cpu")):
        role = ROLE_OF[component(w)]
        (name,) = credential_mounts(w).values()
        directory = mounted(secrets[name], tmp_path / component(w))
        assert Credentials.load(directory, role).role == role


def test_another_namespace_and_a_bad_one(tmp_path):
    from splitserve.cli import main
    from splitserve.k8s_secrets import secrets_yaml

    cluster = make_cluster(tmp_path)
    docs = list(yaml.safe_load_all(secrets_yaml(cluster, "ml-serving")))
    assert {d["metadata"]["namespace"] for d in docs} == {"ml-serving"}
    with pytest.raises(SystemExit, match="namespace"):
        main(["credentials", cluster, "--kubernetes-secrets", str(tmp_path / "x"),
              "--namespace", "Bad_Name"])  # fmt: skip


# ---- the documented cert-manager Certificates ------------------------------------------------


def documented_certificates() -> dict[str, dict]:
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS, re.S)
    docs = [d for b in blocks if "kind: Certificate" in b for d in yaml.safe_load_all(b)]
    return {d["spec"]["secretName"]: d for d in docs if d and d["kind"] == "Certificate"}


def test_the_documented_certificates_carry_the_names_splitserve_credentials_gives(made):
    from cryptography import x509

    cluster = made[0]
    certificates = documented_certificates()
    assert set(certificates) == set(CREDENTIAL_SECRETS)
    for name, certificate in certificates.items():
        role = CREDENTIAL_SECRETS[name]
        spec = certificate["spec"]
        assert certificate["metadata"]["namespace"] == NAMESPACE
        assert spec["commonName"] == role_name(role)  # etcd's user name
        assert {"server auth", "client auth"} <= set(spec["usages"])
        made_cert = x509.load_pem_x509_certificate((cluster / role / "tls.crt").read_bytes())
        sans = made_cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert set(spec["dnsNames"]) == set(sans.get_values_for_type(x509.DNSName)), role
        ips = {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
        assert set(spec.get("ipAddresses", [])) == ips, role
    assert set(ETCD_EXTRA_NAMES) <= set(certificates[secret_name("etcd")]["spec"]["dnsNames"])
