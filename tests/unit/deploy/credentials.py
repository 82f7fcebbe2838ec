"""Who holds which credentials in the rendered manifests, shared by the deploy tests."""

from __future__ import annotations

import base64
import re
import shlex
from pathlib import Path

from common.credentials import ROLES
from splitserve.k8s_secrets import secret_name
from tests.unit.deploy.rendering import component, containers, env_of, named, volumes_of

MOUNT = "/etc/splitserve/credentials"
KEYS = {"ca.crt", "tls.crt", "tls.key"}
# the role each kind of pod runs as (app.kubernetes.io/component -> role)
ROLE_OF = {
    "scheduler": "scheduler",
    "worker": "worker",
    "frontend": "frontend",
    "etcd": "etcd",
    "etcd-auth": "root",
}
CREDENTIAL_SECRETS = {secret_name(role): role for role in ROLES}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def credential_mounts(workload: dict) -> dict[str, str]:
    """mountPath -> Secret name, for every Secret of a role the pod's container mounts."""
    volumes = volumes_of(workload)
    found = {}
    for mount in containers(workload)[0].get("volumeMounts", []):
        # (a StatefulSet's volumeClaimTemplates are no Secret)
        secret = volumes.get(mount["name"], {}).get("secret", {}).get("secretName")
        if secret in CREDENTIAL_SECRETS:
            found[mount["mountPath"]] = secret
    return found


def credentials_dir(workload: dict) -> str:
    """The directory the pod's process reads its credentials from."""
    c = containers(workload)[0]
    if component(workload) == "etcd-auth":
        (arg,) = [a for a in c["args"] if a.startswith("--root-credentials=")]
        return arg.partition("=")[2]
    return env_of(c)["SPLITSERVE_CREDENTIALS"]["value"]


def expand(text: str, values: dict[str, str]) -> str:
    """$VAR and ${VAR} of `values`, as the shell would; any other variable is left as it is."""
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m[1], m[0]), text)


def literal_env(container: dict) -> dict[str, str]:
    return {k: e["value"] for k, e in env_of(container).items() if "value" in e}


def etcd_flags(resources) -> dict[str, list[str]]:
    """etcd's command line, the script's and the container's variables expanded ($POD_NAME
    left as it is): flag -> its values."""
    c = containers(named(resources, "StatefulSet", "splitserve-etcd"))[0]
    values = literal_env(c)
    prelude, _, command = c["args"][0].partition("exec ")
    for name, value in re.findall(r"(\w+)=([^;]+);", prelude):
        values[name] = expand(value.strip('"'), values)
    words = shlex.split(expand(command, values))[1:]  # [0]: the binary's path
    flags: dict[str, list[str]] = {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            takes = i + 1 < len(words) and not words[i + 1].startswith("--")
            flags.setdefault(word, []).append(words[i + 1] if takes else "")
    return flags


def probe_commands(container: dict) -> list[list[str]]:
    """Each exec probe's command as the process sees it (`sh -c` scripts split, the
    container's literal variables expanded)."""
    found = []
    for kind in PROBES:
        command = container.get(kind, {}).get("exec", {}).get("command")
        if not command:
            continue
        if command[:2] == ["sh", "-c"]:
            command = shlex.split(expand(command[2], literal_env(container)).removeprefix("exec "))
        found.append(command)
    return found


def flag_value(command: list[str], flag: str) -> str | None:
    for i, word in enumerate(command):
        if word == flag and i + 1 < len(command):
            return command[i + 1]
        if word.startswith(flag + "="):
            return word.partition("=")[2]
    return None


def make_cluster(tmp_path) -> str:
    """`splitserve credentials DIR --kubernetes-secrets DIR/../s.yaml`; returns DIR."""
    from splitserve.cli import main

    directory = tmp_path / "cluster"
    assert (
        main(["credentials", str(directory), "--kubernetes-secrets", str(tmp_path / "s.yaml")]) == 0
    )
    return str(directory)


def mounted(secret: dict, directory: Path) -> Path:
    """The Secret as the kubelet mounts it: one file per key."""
    directory.mkdir()
    for key, value in secret["data"].items():
        (directory / key).write_bytes(base64.b64decode(value))
    return directory
