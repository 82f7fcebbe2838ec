"""Predicted Outputs through real processes (scheduler without --speculative-config + a
SmolLM2 worker, the shared HTTP cluster): a chat request whose prediction is the text it
produces without one gets the same text, and its drafts are accepted (the spec_decode metrics
and the usage's accepted_prediction_tokens say so)."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.e2e.http_cluster import AUTH, shared_http_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PASSAGE = (
    "The scheduler owns the request queues, the token budget and the KV block tables; each "
    "step it sends the workers a diff of what changed, and the workers send the sampled "
    "tokens back."
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    return shared_http_cluster(tmp_path_factory)


def counter(metrics: str, name: str) -> float:
    pattern = rf"^splitserve:{name}_total(?:{{[^}}]*}})? (\S+)$"
    return sum(float(v) for v in re.findall(pattern, metrics, re.M))


def test_a_prediction_of_the_output_is_accepted_and_changes_nothing(cluster):
    ask = {
        "messages": [{"role": "user", "content": f"Repeat this passage word for word: {PASSAGE}"}],
        "max_tokens": 48,
        "temperature": 0,
    }
    with httpx.Client(base_url=cluster.base_url, headers=AUTH, timeout=300) as http:
        plain = http.post("/v1/chat/completions", json=ask)
        assert plain.status_code == 200, plain.text
        text = plain.json()["choices"][0]["message"]["content"]
        before = http.get("/metrics").text
        prediction = {"type": "content", "content": text}
        predicted = http.post("/v1/chat/completions", json={**ask, "prediction": prediction})
        assert predicted.status_code == 200, predicted.text
        after = http.get("/metrics").text
    body = predicted.json()
    assert body["choices"][0]["message"]["content"] == text
    assert body["usage"]["completion_tokens"] == plain.json()["usage"]["completion_tokens"]
    assert body["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
    accepted = counter(after, "spec_decode_num_accepted_tokens") - counter(
        before, "spec_decode_num_accepted_tokens"
    )
    assert accepted > 0
