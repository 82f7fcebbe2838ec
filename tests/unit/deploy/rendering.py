"""The rendered manifests of deploy/kubernetes, shared by the deploy tests (rendered once)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
KUBE = ROOT / "deploy" / "kubernetes"
NAMESPACE = "splitserve"
# what is rendered and checked: each overlay, and each component on an overlay
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "cpu": ("cpu", ()),
    "gpu": ("gpu", ()),
    "gpu+keda": ("gpu", ("keda",)),
    "cpu+hpa": ("cpu", ("hpa",)),
    "cpu+external-etcd": ("cpu", ("external-etcd",)),
    "cpu+ingress-tls": ("cpu", ("ingress-tls",)),
    "gpu+external-etcd+keda": ("gpu", ("external-etcd", "keda")),
}
LONG_RUNNING_KINDS = ("Deployment", "StatefulSet")
WORKLOAD_KINDS = (*LONG_RUNNING_KINDS, "Job")  # the Job: etcd's auth bootstrap


@functools.cache
def renderer():
    spec = importlib.util.spec_from_file_location("splitserve_kube_render", KUBE / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def _rendered(variant: str) -> tuple:
    overlay, components = VARIANTS[variant]
    return tuple(renderer().render(KUBE / "overlays" / overlay, components))


def rendered(variant: str) -> list[dict[str, Any]]:
    return list(_rendered(variant))


def of_kind(resources: list[dict], kind: str) -> list[dict]:
    return [r for r in resources if r["kind"] == kind]


def named(resources: list[dict], kind: str, name: str) -> dict:
    (found,) = [r for r in of_kind(resources, kind) if r["metadata"]["name"] == name]
    return found


def workloads(resources: list[dict]) -> list[dict]:
    """Everything that runs pods: Deployments, StatefulSets and Jobs."""
    return [r for r in resources if r["kind"] in WORKLOAD_KINDS]


def long_running(resources: list[dict]) -> list[dict]:
    return [r for r in resources if r["kind"] in LONG_RUNNING_KINDS]


def pod_labels(workload: dict) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def containers(workload: dict) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def component(workload: dict) -> str:
    return pod_labels(workload)["app.kubernetes.io/component"]


def volumes_of(workload: dict) -> dict[str, dict]:
    return {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
