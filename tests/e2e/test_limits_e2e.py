"""One large body against a real cluster (issue #35): a 21 MB /v1/completions body gets its 413
and a prompt far over max_model_len its 400, while another client's stream goes on and ends
with exactly the text it gets alone."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.e2e.http_cluster import AUTH, shared_http_cluster

pytestmark = [pytest.mark.e2e]
PROMPT = "The capital of France is"
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    return shared_http_cluster(tmp_path_factory)


def completion(prompt: str) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }


def test_a_21_mb_body_is_refused_while_another_stream_finishes_intact(cluster):
    with cluster.grpc_client() as client:
        reference = client.generate(
            PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
        ).text

    first_chunk = threading.Event()
    streamed: list[str] = []

    def stream() -> None:
        body = {**completion(PROMPT), "stream": True}
        with httpx.stream(
            "POST", cluster.url("/v1/completions"), json=body, headers=AUTH, timeout=120
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    streamed.append(json.loads(line[6:])["choices"][0]["text"])
                    first_chunk.set()

    other = threading.Thread(target=stream)
    other.start()
    try:
        assert first_chunk.wait(120), "the other stream never started"
        huge = json.dumps(completion("x" * 21_000_000)).encode()
        r = httpx.post(
            cluster.url("/v1/completions"),
            content=huge,
            headers={**AUTH, "Content-Type": "application/json"},
            timeout=60,
        )
        assert r.status_code == 413, r.text
        assert "--max-request-bytes" in r.json()["error"]["message"]
        # under the body cap, far over max_model_len: refused before it is tokenized
        r = httpx.post(
            cluster.url("/v1/chat/completions"),
            json={"messages": [{"role": "user", "content": "word " * 600_000}]},
            headers=AUTH,
            timeout=60,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "max_model_len" in r.json()["error"]["message"]
    finally:
        other.join(120)
    assert "".join(streamed) == reference
