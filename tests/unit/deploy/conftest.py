"""The cluster `splitserve credentials --kubernetes-secrets` makes, once per module."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.unit.deploy.credentials import make_cluster


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("credentials")
    cluster = make_cluster(tmp)
    secrets = list(yaml.safe_load_all((tmp / "s.yaml").read_text()))
    return Path(cluster), tmp / "s.yaml", {s["metadata"]["name"]: s for s in secrets}
