"""A cluster's credentials as Kubernetes Secrets: one `kubernetes.io/tls` Secret per role, named
`splitserve-<role>-tls`, with the keys `ca.crt`, `tls.crt` and `tls.key` (what cert-manager
writes), which deploy/kubernetes mounts in that role's pods only. The CA's key is never written.

    splitserve credentials DIR --kubernetes-secrets secrets.yaml   # then kubectl apply -f
"""

from __future__ import annotations

import base64
import os
import re
from pathlib import Path

from common.credentials import CA_FILE, CERT_FILE, KEY_FILE, ROLES, role_name, write_private

NAMESPACE = "splitserve"
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def secret_name(role: str) -> str:
    return f"{role_name(role)}-tls"


def secrets_yaml(cluster: str | os.PathLike[str], namespace: str = NAMESPACE) -> str:
    """The Secrets of every role of `cluster` (a directory `splitserve credentials` made), as
    one YAML stream."""
    if not _DNS_LABEL.fullmatch(namespace):
        raise ValueError(f"{namespace!r} is not a Kubernetes namespace name")
    root = Path(cluster)
    documents = []
    for role in ROLES:
        data = "".join(
            f"  {name}: {base64.b64encode((root / role / name).read_bytes()).decode()}\n"
            for name in (CA_FILE, CERT_FILE, KEY_FILE)
        )
        documents.append(
            "apiVersion: v1\n"
            "kind: Secret\n"
            "metadata:\n"
            f"  name: {secret_name(role)}\n"
            f"  namespace: {namespace}\n"
            "  labels:\n"
            "    app.kubernetes.io/name: splitserve\n"
            f"    splitserve/role: {role}\n"
            "type: kubernetes.io/tls\n"
            f"data:\n{data}"
        )
    return "---\n".join(documents)


def write_secrets(
    cluster: str | os.PathLike[str], path: str | os.PathLike[str], namespace: str = NAMESPACE
) -> Path:
    """Writes secrets_yaml() to `path`, mode 0600 (it holds every role's private key)."""
    target = Path(path)
    write_private(target, secrets_yaml(cluster, namespace).encode())
    return target
