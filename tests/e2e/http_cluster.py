"""One real cluster shared by the HTTP / metrics / dashboard / auth / bench e2e modules.

A scheduler with its HTTP port and an API key, and one SmolLM2 worker. It is
started by the first module that asks (through its own module fixture) and stopped when the
test process exits, so the worker loads the model once for all these modules.
"""

from __future__ import annotations

import atexit
import time
from dataclasses import dataclass

import httpx

from common.client import SplitserveClient
from tests.e2e.conftest import SCHEDULER_FLAGS, WORKER_FLAGS
from tests.e2e.procs import Cluster, free_port

API_KEY = "e2e-api-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@dataclass
class HttpCluster:
    cluster: Cluster
    http_port: int

    @property
    def target(self) -> str:
        return self.cluster.target

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def grpc_client(self, **kwargs) -> SplitserveClient:
        return SplitserveClient(self.target, api_key=API_KEY, timeout=120, **kwargs)

    def openai(self, api_key: str = API_KEY):
        import openai

        return openai.OpenAI(
            base_url=self.base_url + "/v1", api_key=api_key, max_retries=0, timeout=120
        )

    def wait_idle(self, timeout: float = 30.0):
        """Until nothing is in flight and every block is free again; returns the server info."""
        deadline = time.monotonic() + timeout
        with self.grpc_client() as client:
            while True:
                info = client.server_info()
                busy = info.num_requests_in_flight or any(
                    w.num_running or w.num_waiting or w.num_free_blocks != w.num_blocks
                    for w in info.workers
                )
                if not busy:
                    return info
                assert time.monotonic() < deadline, f"still busy: {info}"
                time.sleep(0.05)


_shared: HttpCluster | None = None


def shared_http_cluster(tmp_path_factory) -> HttpCluster:
    global _shared
    if _shared is not None:
        return _shared
    c = Cluster(tmp_path_factory.mktemp("http-cluster"))
    http_port = free_port()
    try:
        c.start_scheduler(
            *SCHEDULER_FLAGS,
            "--http-port",
            str(http_port),
            "--api-key",
            API_KEY,
        )
        c.start_worker("w0", *WORKER_FLAGS)
        with SplitserveClient(c.target, api_key=API_KEY) as client:
            client.wait_for_workers(1, timeout=240)
        deadline = time.monotonic() + 30
        while httpx.get(f"http://127.0.0.1:{http_port}/ready").status_code != 200:
            assert time.monotonic() < deadline, "/ready never became 200"
            time.sleep(0.1)
    except BaseException:
        print(c.logs())
        c.stop_all()
        raise
    atexit.register(c.stop_all)
    _shared = HttpCluster(c, http_port)
    return _shared
