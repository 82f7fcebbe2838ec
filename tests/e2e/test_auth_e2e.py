"""The API key on both protocols (workers and front-ends prove themselves by mutual TLS, not by
the key: tests/unit/scheduler/test_link_auth.py, tests/e2e/test_attacks.py)."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.client import SplitserveClient
from tests.e2e.http_cluster import API_KEY, shared_http_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    return shared_http_cluster(tmp_path_factory)


def test_grpc_needs_the_key_but_health_checks_stay_open(cluster):
    for key in (None, "wrong-key"):
        with SplitserveClient(cluster.target, api_key=key, timeout=30) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.generate("Hello", max_tokens=2)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "API key" in err.value.details()
            with pytest.raises(grpc.RpcError) as err:
                client.server_info()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with SplitserveClient(cluster.target, api_key=API_KEY, timeout=120) as client:
        result = client.generate("Hello", max_tokens=2, temperature=0.0, ignore_eos=True)
        assert result.finish_reason == "length" and len(result.token_ids) == 2
    with grpc.insecure_channel(cluster.target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_http_needs_the_key_but_probes_metrics_and_dashboard_stay_open(cluster):
    with pytest.raises(openai.AuthenticationError) as err:
        cluster.openai(api_key="wrong-key").models.list()
    assert "API key" in err.value.message
    r = httpx.post(cluster.url("/v1/completions"), json={"prompt": "hi"})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    assert cluster.openai().models.list().data[0].id == "SmolLM2-135M-Instruct"
    for path in ("/health", "/ready", "/metrics", "/dashboard", "/dashboard/api/state"):
        assert httpx.get(cluster.url(path)).status_code == 200, path
