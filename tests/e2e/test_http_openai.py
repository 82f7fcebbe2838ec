"""The OpenAI-compatible HTTP API of a real scheduler + SmolLM2 worker, driven by `openai`."""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import openai
import pytest

from common.tokenizer import load_tokenizer
from tests.e2e.http_cluster import AUTH, shared_http_cluster
from tests.e2e.procs import Cluster, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = "The capital of France is"
MAX_TOKENS = 8
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    return shared_http_cluster(tmp_path_factory)


@pytest.fixture(scope="module")
def oai(cluster):
    return cluster.openai()


@pytest.fixture(scope="module")
def model(oai):
    (card,) = oai.models.list().data
    return card.id


@pytest.fixture(scope="module")
def grpc_greedy(cluster):
    with cluster.grpc_client() as client:
        text = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        chat = client.generate(messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0)
    return text, chat


def test_models_lists_the_served_model(oai, model):
    assert model == "SmolLM2-135M-Instruct"
    assert oai.models.retrieve(model).id == model


def test_completion_equals_grpc_greedy_with_exact_usage(oai, model, grpc_greedy):
    expected, _ = grpc_greedy
    r = oai.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == expected.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(load_tokenizer(None).encode(PROMPT))
    assert r.usage.completion_tokens == MAX_TOKENS
    assert r.usage.total_tokens == r.usage.prompt_tokens + MAX_TOKENS


def test_completion_streamed_with_usage_and_token_id_prompt(oai, model, grpc_greedy):
    expected, _ = grpc_greedy
    ids = load_tokenizer(None).encode(PROMPT)
    stream = oai.completions.create(
        model=model,
        prompt=ids,  # token ids, as `bench serve` sends them
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == MAX_TOKENS
    assert usage.usage.prompt_tokens == len(ids)
    text_chunks = chunks[:-1]
    # streamed: a chunk per token, unless the scheduler or this client fell behind (the
    # adaptive --stream-interval and a lagging reader both merge tokens into fewer chunks)
    assert 2 <= len(text_chunks) <= MAX_TOKENS
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert text_chunks[-1].choices[0].finish_reason == "length"


def test_chat_equals_grpc_chat_streamed_and_not(oai, model, grpc_greedy):
    _, expected = grpc_greedy
    whole = oai.chat.completions.create(
        model=model, messages=MESSAGES, max_completion_tokens=MAX_TOKENS, temperature=0
    )
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected.text
    assert whole.usage.completion_tokens == expected.completion_tokens
    assert whole.usage.prompt_tokens == expected.prompt_tokens
    chunks = list(
        oai.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stop_string_and_seeded_sampling(oai, model, grpc_greedy):
    expected, _ = grpc_greedy
    assert "." in expected.text
    r = oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=["."]
    )
    assert r.choices[0].text == expected.text.split(".")[0]
    assert r.choices[0].finish_reason == "stop"
    kwargs = dict(
        model=model,
        prompt=PROMPT,
        max_tokens=4,
        temperature=1.0,
        seed=7,
        top_p=0.9,
        extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1},
    )
    assert oai.completions.create(**kwargs).choices[0].text == (
        oai.completions.create(**kwargs).choices[0].text
    )


def test_n_choices_and_best_of_with_the_official_client(cluster, oai, model, grpc_greedy):
    expected, chat_expected = grpc_greedy
    r = oai.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        n=4,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [expected.text] * 4  # greedy: each equals n=1
    assert r.usage.prompt_tokens == len(load_tokenizer(None).encode(PROMPT))
    assert r.usage.completion_tokens == 4 * MAX_TOKENS
    cluster.wait_idle()  # every block back in the pool once the group ended
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=3, n=4)
    sampled = [c.text for c in oai.completions.create(**kwargs).choices]
    assert len(set(sampled)) > 1  # a seed stream per choice (seed + index)
    assert sampled == [c.text for c in oai.completions.create(**kwargs).choices]
    stream = oai.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, n=2, stream=True
    )
    parts = ["", ""]
    for chunk in stream:  # assembled by index, as the client's users do
        for choice in chunk.choices:
            parts[choice.index] += choice.delta.content or ""
    assert parts == [chat_expected.text] * 2
    best = oai.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=6,
        temperature=1.0,
        seed=5,
        n=2,
        best_of=4,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == 4 * 6  # all four were generated


ADDRESSED = {  # nested objects, arrays, enums, required fields
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 30},
                "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "tags": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "label": {"type": "string", "maxLength": 10},
                    "weight": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["label", "weight"],
                "additionalProperties": False,
            },
            "maxItems": 2,
        },
    },
    "required": ["name", "role", "address", "tags"],
    "additionalProperties": False,
}

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}


def valid_person(data) -> bool:
    return (
        isinstance(data, dict)
        and set(data) == {"name", "age", "city", "hobbies"}
        and isinstance(data["name"], str)
        and len(data["name"]) <= 20
        and isinstance(data["age"], int)
        and 0 <= data["age"] <= 120
        and data["city"] in ("Paris", "London", "Tokyo")
        and isinstance(data["hobbies"], list)
        and len(data["hobbies"]) <= 3
        and all(isinstance(h, str) and len(h) <= 12 for h in data["hobbies"])
    )


def test_structured_output_holds_at_any_temperature(oai, model):
    def ask(content: str, fmt: dict, temperature: float, seed: int | None, max_tokens: int):
        return oai.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            response_format=fmt,
        ).choices[0]

    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    for temperature, seed in ((0.0, None), (1.0, 1), (1.5, 2)):
        choice = ask("Describe a person as JSON.", fmt, temperature, seed, 160)
        assert choice.finish_reason == "stop", choice.message.content
        assert valid_person(json.loads(choice.message.content))
    r = oai.completions.create(
        model=model,
        prompt="Call me at",
        max_tokens=20,
        temperature=1.0,
        seed=3,
        extra_body={"guided_regex": r" \d{3}-\d{4}"},
    )
    assert re.fullmatch(r" \d{3}-\d{4}", r.choices[0].text)
    r = oai.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=10,
        temperature=1.0,
        extra_body={"guided_choice": [" Paris", " London", " Madrid"]},
    )
    assert r.choices[0].text in (" Paris", " London", " Madrid")
    nested = {"type": "json_schema", "json_schema": {"name": "user", "schema": ADDRESSED}}
    for temperature, seed in ((0.0, None), (1.0, 4)):
        choice = ask("A user record as JSON.", nested, temperature, seed, 200)
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), ADDRESSED)
        choice = ask(
            "Describe Paris as a JSON object.", {"type": "json_object"}, temperature, seed, 200
        )
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # ran out of tokens first: a prefix of an object, and said so
            assert choice.finish_reason == "length"
            assert choice.message.content.lstrip().startswith("{")
    short = ask("Describe a person as JSON.", {"type": "json_object"}, 0, None, 4)
    assert short.finish_reason == "length"
    assert short.message.content.startswith("{")
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(
            model=model,
            messages=MESSAGES,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": 7}},
            },
        )
    assert "json_schema is not valid" in err.value.message


def test_logprobs_on_chat(oai, model):
    r = oai.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_errors_have_openai_status_codes(cluster, oai, model):
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=-1)
    assert "temperature" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=model, prompt=PROMPT, max_tokens=2, n=17)
    assert "n must be in [1, 16]" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=model, messages=[{"role": "user"}])
    assert err.value.code == "invalid_request" and "needs content" in err.value.message
    with pytest.raises(openai.NotFoundError) as err:
        oai.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert "unknown model" in err.value.message
    with pytest.raises(openai.AuthenticationError):
        cluster.openai(api_key="wrong").completions.create(model=model, prompt=PROMPT)
    r = httpx.get(cluster.url("/v1/nothing"), headers=AUTH)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_client_disconnect_mid_stream_frees_its_blocks(cluster, model):
    payload = {
        "model": model,
        "prompt": "Tell me a long story.",
        "max_tokens": 300,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", cluster.url("/v1/completions"), json=payload, headers=AUTH) as r:
            assert r.status_code == 200
            lines, events = r.iter_lines(), 0  # keep the iterator: dropping it closes the stream
            for line in lines:
                events += line.startswith("data: ")
                if events >= 3:
                    break
            with cluster.grpc_client() as client:
                info = client.server_info()
            assert info.num_requests_in_flight == 1
    # the connection is closed: the request must be dropped and every KV block freed
    info = cluster.wait_idle(timeout=30)
    assert info.num_requests_in_flight == 0


def test_no_worker_is_503_and_readiness_apart_from_liveness(tmp_path):
    c = Cluster(tmp_path)
    port = free_port()
    try:
        c.start_scheduler("--worker-wait-timeout", "1", "--http-port", str(port))
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                health = httpx.get(base + "/health")
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert health.status_code == 200
        ready = httpx.get(base + "/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "no worker attached"
        oai = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=30)
        with pytest.raises(openai.APIStatusError) as err:
            oai.completions.create(model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=2)
        assert err.value.status_code == 503
        assert "no worker" in err.value.message
    finally:
        c.stop_all()


def test_cluster_view_shows_each_workers_kernels(cluster):
    body = httpx.get(cluster.url("/cluster"), headers=AUTH, timeout=10).json()
    (worker,) = body["workers"]
    assert worker["state"] == "active" and worker["pid"] > 0
    # the worker's CPU level and kernel per op family, as its registration reported them
    assert "linear=" in worker["kernels"] and "decode-attention=" in worker["kernels"]
