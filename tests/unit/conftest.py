"""Fixtures the service tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from common.etcd_server import EtcdServer


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdServer]:
    """A real etcd (common/etcd_server.py) for one test module."""
    server = EtcdServer(unsafe_no_fsync=True)
    server.start()
    yield server
    server.stop()
