#!/usr/bin/env python3
"""Render a kustomization of deploy/kubernetes/ without kustomize, as `kubectl kustomize` would.

    python deploy/kubernetes/render.py deploy/kubernetes/overlays/cpu > splitserve.yaml
    python deploy/kubernetes/render.py deploy/kubernetes/overlays/gpu --component keda

The subset of kustomize these manifests use, and nothing more (anything else in a
kustomization.yaml is an error, so the two cannot drift apart silently): `resources` (files and
directories), `components`, `patches` (strategic-merge files, `$patch: delete` included),
`images` (newName, newTag) and `namespace`. `--component NAME` adds components/NAME, as a
`components:` entry in the overlay would. Needs PyYAML only. tests/unit/deploy runs it.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent
KNOWN_FIELDS = {"apiVersion", "kind", "resources", "components", "patches", "images", "namespace"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass"}
# strategic merge: the key that identifies an item of these lists (Kubernetes' patchMergeKey);
# any other list is replaced whole, as Kubernetes does for lists without one
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "imagePullSecrets": "name",
    "volumeMounts": "mountPath",
}

Resource = dict[str, Any]


def load_documents(path: Path) -> list[Resource]:
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def resource_id(res: Resource) -> tuple[str, str, str]:
    group = res.get("apiVersion", "").rpartition("/")[0]
    return group, res["kind"], res["metadata"]["name"]


def _merge_key(field: str, items: list) -> str | None:
    if field == "ports":  # a container's ports merge on containerPort, a Service's on port
        first = next((i for i in items if isinstance(i, dict)), {})
        return "containerPort" if "containerPort" in first else "port"
    return MERGE_KEYS.get(field)


def merge(base: Any, patch: Any, field: str = "") -> Any:
    """Strategic merge of `patch` into a copy of `base`."""
    if isinstance(base, dict) and isinstance(patch, dict):
        if patch.get("$patch") == "replace":
            return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list):
        key = _merge_key(field, base + patch)
        if key is None:
            return copy.deepcopy(patch)
        out = copy.deepcopy(base)
        for item in patch:
            index = next((i for i, b in enumerate(out) if b.get(key) == item.get(key)), None)
            if item.get("$patch") == "delete":
                if index is not None:
                    out.pop(index)
            elif index is None:
                out.append(copy.deepcopy(item))
            else:
                out[index] = merge(out[index], item, field)
        return out
    return copy.deepcopy(patch)


def apply_patch(resources: list[Resource], patch: Resource, source: Path) -> list[Resource]:
    target = resource_id(patch)
    matches = [i for i, r in enumerate(resources) if resource_id(r) == target]
    if not matches:
        raise ValueError(f"{source}: the patch targets {target}, which no resource is")
    (index,) = matches
    if patch.get("$patch") == "delete":
        return resources[:index] + resources[index + 1 :]
    merged = merge(resources[index], patch)
    return resources[:index] + [merged] + resources[index + 1 :]


def set_image(res: Resource, rules: list[dict]) -> None:
    spec = res.get("spec", {}).get("template", {}).get("spec", {})
    for container in spec.get("containers", []) + spec.get("initContainers", []):
        name, _, tag = container["image"].partition(":")
        for rule in rules:
            if rule["name"] == name:
                name = rule.get("newName", name)
                tag = rule.get("newTag", tag)
        container["image"] = f"{name}:{tag}" if tag else name


def build(directory: Path, extra_components: tuple[Path, ...] = ()) -> list[Resource]:
    """The resources a kustomization (or a component) directory renders to, in order."""
    spec = load_documents(directory / "kustomization.yaml")[0]
    unknown = set(spec) - KNOWN_FIELDS
    if unknown:
        raise ValueError(f"{directory}/kustomization.yaml: unsupported fields {sorted(unknown)}")
    resources: list[Resource] = []
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        resources += build(path) if path.is_dir() else load_documents(path)
    components = [(directory / c).resolve() for c in spec.get("components", [])]
    for component in [*components, *extra_components]:
        resources = apply_component(resources, component)
    resources = apply_transformers(resources, spec, directory)
    seen = [resource_id(r) for r in resources]
    duplicates = {i for i in seen if seen.count(i) > 1}
    if duplicates:
        raise ValueError(f"{directory}: resources defined twice: {sorted(duplicates)}")
    return resources


def apply_component(resources: list[Resource], directory: Path) -> list[Resource]:
    spec = load_documents(directory / "kustomization.yaml")[0]
    if spec.get("kind") != "Component":
        raise ValueError(f"{directory} is not a kustomize Component")
    unknown = set(spec) - KNOWN_FIELDS
    if unknown:
        raise ValueError(f"{directory}/kustomization.yaml: unsupported fields {sorted(unknown)}")
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        resources = resources + (build(path) if path.is_dir() else load_documents(path))
    return apply_transformers(resources, spec, directory)


def apply_transformers(resources: list[Resource], spec: dict, directory: Path) -> list[Resource]:
    for entry in spec.get("patches", []):
        if set(entry) != {"path"}:
            raise ValueError(f"{directory}: only `patches: - path: FILE` is supported")
        source = directory / entry["path"]
        for patch in load_documents(source):
            resources = apply_patch(resources, patch, source)
    resources = copy.deepcopy(resources)
    if spec.get("images"):
        for res in resources:
            set_image(res, spec["images"])
    namespace = spec.get("namespace")
    if namespace:
        for res in resources:
            if res["kind"] not in CLUSTER_SCOPED:
                res["metadata"]["namespace"] = namespace
    return resources


def render(directory: Path, components: tuple[str, ...] = ()) -> list[Resource]:
    return build(directory.resolve(), tuple(ROOT / "components" / c for c in components))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="an overlay, e.g. overlays/cpu")
    parser.add_argument(
        "--component", action="append", default=[], help="also apply components/NAME"
    )
    args = parser.parse_args(argv)
    resources = render(args.directory, tuple(args.component))
    yaml.safe_dump_all(resources, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
