"""/metrics of a real scheduler: Prometheus text that moves exactly as requests run."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.http_cluster import AUTH, shared_http_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    return shared_http_cluster(tmp_path_factory)


def scrape(cluster) -> dict[str, float]:
    r = httpx.get(cluster.url("/metrics"))  # open without the API key (documented)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    values = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return values


def test_metrics_move_with_requests_on_both_protocols(cluster):
    cluster.wait_idle()
    before = scrape(cluster)
    lengths = [3, 4, 5]
    for n in lengths:
        r = httpx.post(
            cluster.url("/v1/completions"),
            headers=AUTH,
            json={
                "prompt": f"Count to {n}:",
                "max_tokens": n,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
    with cluster.grpc_client() as client:
        result = client.generate("Hello there", max_tokens=2, temperature=0.0, ignore_eos=True)
    assert result.completion_tokens == 2
    cluster.wait_idle()
    after = scrape(cluster)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    generated = sum(lengths) + 2
    assert delta("splitserve:generation_tokens_total") == generated
    assert delta("splitserve:time_to_first_token_seconds_count") == 4
    assert delta("splitserve:e2e_request_latency_seconds_count") == 4
    assert delta("splitserve:request_queue_time_seconds_count") == 4
    assert delta("splitserve:time_per_output_token_seconds_count") == 4
    assert delta("splitserve:inter_token_latency_seconds_count") == generated - 4
    assert delta("splitserve:request_success_total{finished_reason=length}") == 4
    assert delta("splitserve:prompt_tokens_total") > 0
    assert delta("splitserve:step_time_seconds_count{worker=w0}") >= max(lengths)
    assert delta("splitserve:scheduler_steps_total{worker=w0}") >= max(lengths)
    # per-worker gauges read at scrape time
    assert after["splitserve:workers_attached"] == 1
    assert after["splitserve:num_requests_running{worker=w0}"] == 0
    assert after["splitserve:num_requests_waiting{worker=w0}"] == 0
    assert after["splitserve:num_requests_swapped{worker=w0}"] == 0
    assert after["splitserve:kv_cache_usage_perc{worker=w0}"] == 0.0
    assert after["splitserve:kv_cache_blocks_total{worker=w0}"] == 192
    for name in (
        "num_preemptions_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "recomputed_tokens_total",
    ):
        assert f"splitserve:{name}{{worker=w0}}" in after, name
    assert delta("splitserve:prefix_cache_queries_total{worker=w0}") > 0
    # histograms are cumulative: the +Inf bucket equals the count
    assert (
        after["splitserve:time_to_first_token_seconds_bucket{le=+Inf}"]
        == after["splitserve:time_to_first_token_seconds_count"]
    )


def test_kv_usage_and_running_gauges_move_while_a_request_runs(cluster):
    cluster.wait_idle()
    payload = {
        "prompt": "Write a long poem about the sea.",
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", cluster.url("/v1/completions"), json=payload, headers=AUTH, timeout=120
    ) as r:
        seen, lines = 0, r.iter_lines()  # keep the iterator: dropping it closes the stream
        for line in lines:
            seen += line.startswith("data: ")
            if seen >= 2:
                break
        during = scrape(cluster)
    assert during["splitserve:num_requests_running{worker=w0}"] == 1
    assert 0 < during["splitserve:kv_cache_usage_perc{worker=w0}"] <= 1
    assert during["splitserve:num_requests_in_flight"] == 1
    cluster.wait_idle()
    after = scrape(cluster)
    assert after["splitserve:request_success_total{finished_reason=abort}"] >= 1
    assert after["splitserve:kv_cache_usage_perc{worker=w0}"] == 0.0
