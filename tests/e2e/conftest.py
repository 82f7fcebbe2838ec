from pathlib import Path

import pytest

from common.client import SplitserveClient
from tests.e2e.procs import Cluster

HERE = Path(__file__).resolve().parent

WORKER_FLAGS = ("--num-gpu-blocks", "192", "--block-size", "16")
SCHEDULER_FLAGS = (
    "--max-model-len",
    "1024",
    "--max-num-batched-tokens",
    "256",
    "--max-num-seqs",
    "32",
    "--worker-wait-timeout",
    "2",
)


def pytest_collection_modifyitems(items):
    """Every test under tests/e2e/ is marked e2e (a new module that forgets its pytestmark too),
    so `make test-fast` (-m "not slow and not e2e") never starts a cluster."""
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    c.start_scheduler(*SCHEDULER_FLAGS)
    c.start_worker("w0", *WORKER_FLAGS)
    try:
        with SplitserveClient(c.target) as client:
            client.wait_for_workers(1, timeout=240)
        yield c
    except BaseException:
        print(c.logs())
        raise
    finally:
        c.stop_all()


@pytest.fixture
def client(cluster):
    with SplitserveClient(cluster.target, timeout=120) as c:
        yield c
