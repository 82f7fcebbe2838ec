"""The overlays render, and every object is valid for the last three Kubernetes minor versions,
checked offline against the API schemas kubernetes-validate ships (strict: no unknown field)."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest
import yaml

from tests.unit.deploy.rendering import KUBE, NAMESPACE, VARIANTS, rendered

LATEST = kubernetes_validate.latest_version()  # of the pinned kubernetes-validate
MAJOR, MINOR = (int(x) for x in LATEST.split(".")[:2])
VERSIONS = [f"{MAJOR}.{MINOR - i}" for i in range(3)]
CLUSTER_SCOPED = {"Namespace"}
# custom resources: no schema in kubernetes-validate; their shape is checked in test_wiring
CUSTOM_GROUPS = ("keda.sh/",)


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_renders_with_every_object_in_the_namespace(variant):
    resources = rendered(variant)
    assert resources
    for res in resources:
        if res["kind"] not in CLUSTER_SCOPED:
            assert res["metadata"].get("namespace") == NAMESPACE, res["metadata"]["name"]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_is_valid_for_the_kubernetes_version(version):
    unique: dict[str, dict] = {}
    for variant in VARIANTS:
        for res in rendered(variant):
            if not res["apiVersion"].startswith(CUSTOM_GROUPS):
                unique.setdefault(json.dumps(res, sort_keys=True), res)
    problems = []
    for res in unique.values():
        try:
            kubernetes_validate.validate(res, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(p) for p in exc.caught.absolute_path)
            problems.append(
                f"{res['kind']}/{res['metadata']['name']} {where}: {exc.caught.message}"
            )
    assert not problems, "\n".join(problems)


def test_the_three_versions_are_the_latest_minors():
    assert LATEST.startswith(VERSIONS[0]) and len(set(VERSIONS)) == 3


def test_manifest_files_use_no_yaml_aliases():
    """kustomize reads the same files: anchors and aliases are left out for its YAML library."""
    for path in KUBE.rglob("*.yaml"):
        for event in yaml.parse(path.read_text()):
            assert not isinstance(event, yaml.AliasEvent), f"{path}: a YAML alias"


def test_strategic_merge_merges_lists_by_their_key_and_replaces_the_others():
    from tests.unit.deploy.rendering import renderer

    merge = renderer().merge
    base = {
        "containers": [
            {"name": "a", "env": [{"name": "X", "value": "1"}], "args": ["p", "q"]},
            {"name": "b"},
        ],
        "tolerations": [{"key": "t"}],
    }
    patch = {
        "containers": [
            {"name": "a", "env": [{"name": "Y", "value": "2"}], "args": ["r"]},
            {"name": "b", "$patch": "delete"},
        ],
        "tolerations": [{"key": "u"}],
    }
    out = merge(base, patch)
    assert out["containers"] == [
        {
            "name": "a",
            "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}],
            "args": ["r"],
        }
    ]
    assert out["tolerations"] == [{"key": "u"}]
    assert base["containers"][1] == {"name": "b"}  # the input is left alone


def test_renderer_refuses_what_it_does_not_implement(tmp_path):
    from tests.unit.deploy.rendering import renderer

    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources: [x.yaml]\ncommonLabels: {a: b}\n"
    )
    (tmp_path / "x.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    with pytest.raises(ValueError, match="commonLabels"):
        renderer().render(tmp_path)


def test_a_patch_without_a_target_is_an_error(tmp_path):
    from tests.unit.deploy.rendering import renderer

    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources: [x.yaml]\npatches: [{path: p.yaml}]\n"
    )
    (tmp_path / "x.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    (tmp_path / "p.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: y}\n")
    with pytest.raises(ValueError, match="no resource is"):
        renderer().render(tmp_path)
