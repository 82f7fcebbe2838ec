"""A corpus of hostile and broken input over gRPC and HTTP. Each case gets the documented
status and a sentence; afterwards the service still serves and no KV block is held. The HTTP
bodies are in malformed_bodies.jsonl: each a 400 (404 for an unknown model) in OpenAI's error
shape, naming the field at fault."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import grpc
import httpx
import pytest

from common.client import SplitserveClient
from tests.e2e.procs import Cluster, free_port

pytestmark = [pytest.mark.e2e]
VOCAB = 49152
MAX_LEN = 512
INVALID, NOT_FOUND, EXHAUSTED = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("corpus"))
    http_port = free_port()
    c.start_scheduler(
        "--http-port",
        str(http_port),
        "--max-model-len",
        str(MAX_LEN),
        "--tenants",
        "alpha,beta",
        "--max-message-bytes",
        str(1 << 20),
    )
    c.start_worker("w", "--simulate", "--sim-step-base-ms", "2")
    with SplitserveClient(c.target, timeout=30) as client:
        client.wait_for_workers(1, timeout=60)
        yield c, client, f"http://127.0.0.1:{http_port}"
    c.stop_all()


def wait_idle(client: SplitserveClient) -> None:
    """Nothing in flight and every worker's KV blocks free again."""
    deadline = time.monotonic() + 10
    while True:
        info = client.server_info()
        idle = info.num_requests_in_flight == 0
        if idle and all(w.num_free_blocks == w.num_blocks for w in info.workers):
            return
        assert time.monotonic() < deadline, f"blocks held or requests stuck: {info}"
        time.sleep(0.02)


def assert_healthy(client: SplitserveClient) -> None:
    result = client.generate(token_ids=[11, 12, 13], max_tokens=2, ignore_eos=True)
    assert result.finish_reason == "length"
    wait_idle(client)


GRPC_CASES = [
    # (name, kwargs for client.generate, expected code, a word of the sentence)
    ("empty text", dict(prompt=""), INVALID, "empty"),
    ("no input", dict(), INVALID, "empty"),
    ("zero token ids", dict(token_ids=[]), INVALID, "empty"),
    ("max_model_len+1 tokens", dict(token_ids=[5] * (MAX_LEN + 1)), INVALID, "max_model_len"),
    ("exactly max_model_len tokens", dict(token_ids=[5] * MAX_LEN), INVALID, "max_model_len"),
    ("token id -1", dict(token_ids=[1, -1]), INVALID, "vocabulary"),
    ("token id = vocab", dict(token_ids=[VOCAB]), INVALID, "vocabulary"),
    ("token id 2^40", dict(token_ids=[2**40]), INVALID, "vocabulary"),
    ("max_tokens 0", dict(prompt="hi", max_tokens=0), INVALID, "max_tokens"),
    ("max_tokens -5", dict(prompt="hi", max_tokens=-5), INVALID, "max_tokens"),
    (
        "max_tokens over the remaining context",
        dict(token_ids=[5] * (MAX_LEN - 4), max_tokens=5),
        INVALID,
        "max_tokens",
    ),
    ("max_tokens 2^31-1", dict(prompt="hi", max_tokens=2**31 - 1), INVALID, "max_tokens"),
    ("min_tokens -1", dict(prompt="hi", min_tokens=-1), INVALID, "min_tokens"),
    ("min_tokens > max", dict(prompt="hi", max_tokens=2, min_tokens=5), INVALID, "min_tokens"),
    ("temperature NaN", dict(prompt="hi", temperature=math.nan), INVALID, "temperature"),
    ("temperature inf", dict(prompt="hi", temperature=math.inf), INVALID, "temperature"),
    ("temperature -1", dict(prompt="hi", temperature=-1.0), INVALID, "temperature"),
    ("top_p 0", dict(prompt="hi", top_p=0.0), INVALID, "top_p"),
    ("top_p 1.0001", dict(prompt="hi", top_p=1.0001), INVALID, "top_p"),
    ("top_p NaN", dict(prompt="hi", top_p=math.nan), INVALID, "top_p"),
    ("top_k -1", dict(prompt="hi", top_k=-1), INVALID, "top_k"),
    ("min_p -0.1", dict(prompt="hi", min_p=-0.1), INVALID, "min_p"),
    ("min_p 1.5", dict(prompt="hi", min_p=1.5), INVALID, "min_p"),
    ("min_p NaN", dict(prompt="hi", min_p=math.nan), INVALID, "min_p"),
    ("repetition_penalty 0", dict(prompt="hi", repetition_penalty=0.0), INVALID, "repetition"),
    (
        "repetition_penalty inf",
        dict(prompt="hi", repetition_penalty=math.inf),
        INVALID,
        "repetition",
    ),
    ("presence_penalty 3", dict(prompt="hi", presence_penalty=3.0), INVALID, "presence"),
    ("presence_penalty NaN", dict(prompt="hi", presence_penalty=math.nan), INVALID, "presence"),
    (
        "frequency_penalty -inf",
        dict(prompt="hi", frequency_penalty=-math.inf),
        INVALID,
        "frequency",
    ),
    ("logprobs -1", dict(prompt="hi", logprobs=-1), INVALID, "logprobs"),
    ("logprobs 1000", dict(prompt="hi", logprobs=1000), INVALID, "logprobs"),
    (
        "stop token outside vocab",
        dict(prompt="hi", stop_token_ids=[VOCAB + 1]),
        INVALID,
        "vocabulary",
    ),
    ("too many stop strings", dict(prompt="hi", stop=["x"] * 17), INVALID, "stop"),
    ("huge stop string", dict(prompt="hi", stop=["x" * 1000]), INVALID, "stop"),
    ("unknown model", dict(prompt="hi", model="gpt-17"), INVALID, "unknown model"),
    ("unknown tenant", dict(prompt="hi", tenant="mallory"), INVALID, "unknown tenant"),
    ("priority out of range", dict(prompt="hi", priority=2**31 - 1), INVALID, "priority"),
    ("negative deadline", dict(prompt="hi", deadline_s=-1.0), INVALID, "deadline"),
    ("NaN deadline", dict(prompt="hi", deadline_s=math.nan), INVALID, "deadline"),
    ("request id too long", dict(prompt="hi", request_id="r" * 300), INVALID, "request_id"),
    ("empty chat", dict(messages=[]), INVALID, "chat"),
    ("unknown chat role", dict(messages=[{"role": "wizard", "content": "hi"}]), INVALID, "role"),
    ("oversized message", dict(prompt="x" * (2 << 20)), EXHAUSTED, "larger than max"),
]


@pytest.mark.parametrize("name,kwargs,code,needle", GRPC_CASES, ids=[c[0] for c in GRPC_CASES])
def test_grpc_bad_input(system, name, kwargs, code, needle):
    _, client, _ = system
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt", None)
    with pytest.raises(grpc.RpcError) as err:
        client.generate(prompt, **kwargs)
    assert err.value.code() == code, err.value.details()
    assert needle.lower() in err.value.details().lower(), err.value.details()
    assert_healthy(client)


def raw_generate(cluster, payload: bytes):
    with grpc.insecure_channel(cluster.target) as channel:
        call = channel.unary_stream(
            "/splitserve.v1.Generation/Generate",
            request_serializer=None,
            response_deserializer=None,
        )
        return list(call(payload, timeout=10))


@pytest.mark.parametrize(
    "payload",
    [
        b"\xff\xff\xff\xff",  # not protobuf at all
        b"\x12\x05ab",  # a length that runs past the end
        b"\x12\x02\xc3\x28",  # text field with invalid UTF-8
        b"\x1a\x03\x08\x01",  # token_ids (message) with a truncated inner field
        b"\x38" + b"\xff" * 11,  # priority varint longer than 10 bytes
    ],
    ids=["garbage", "truncated", "invalid-utf8", "bad-nested", "overlong-varint"],
)
def test_malformed_protobuf_is_refused(system, payload):
    cluster, client, _ = system
    with pytest.raises(grpc.RpcError) as err:
        raw_generate(cluster, payload)
    assert err.value.code() == INVALID
    assert "not a valid splitserve.v1.GenerateRequest" in err.value.details()
    assert_healthy(client)


def test_control_characters_and_odd_unicode_are_served(system):
    _, client, _ = system
    result = client.generate(
        "\x00\x01\x1b[31m\u202e\ufeff tab\there", max_tokens=3, ignore_eos=True
    )
    assert result.finish_reason == "length" and len(result.token_ids) == 3
    assert_healthy(client)


def test_abort_unknown_and_finished_ids(system):
    _, client, _ = system
    done = client.generate(token_ids=[5, 6], max_tokens=1, request_id="finished-one")
    assert done.finish_reason
    for rid in ("never-seen", "finished-one", ""):
        with pytest.raises(grpc.RpcError) as err:
            client.abort(rid)
        assert err.value.code() == NOT_FOUND and "no request" in err.value.details()
    assert_healthy(client)


CORPUS = Path(__file__).with_name("malformed_bodies.jsonl")


def load_corpus() -> list[dict]:
    """malformed_bodies.jsonl: one case a line, `#` lines are comments (its header says what
    each field means and how `raw` bytes are written)."""
    lines = CORPUS.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip() and not line.startswith("#")]


def body_bytes(case: dict) -> bytes:
    if "raw" in case:
        return case["raw"].encode("latin-1")  # one character per byte
    return json.dumps(case["body"]).encode()


def assert_openai_error(response: httpx.Response, status: int, param: str | None) -> dict:
    """Exactly OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"].strip(), error
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert error["code"] is None or isinstance(error["code"], str), error  # never a number
    assert error["param"] == param, error
    return error


def post(base: str, path: str, content: bytes) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(base + path, content=content, headers=headers, timeout=30)


CASES = load_corpus()


def test_the_corpus_holds_100_distinct_malformed_bodies():
    bodies = {(c["endpoint"], body_bytes(c)) for c in CASES}
    assert len(bodies) == len(CASES) >= 100
    assert {c["endpoint"] for c in CASES} == {
        "/v1/chat/completions",
        "/v1/completions",
        "/tokenize",
        "/detokenize",
    }
    assert all(c["status"] in (400, 404) and c["why"] for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[f"{i:03d}-{c['why']}" for i, c in enumerate(CASES)])
def test_a_malformed_body_is_refused_and_the_next_request_is_served(system, case):
    _, client, base = system
    response = post(base, case["endpoint"], body_bytes(case))
    error = assert_openai_error(response, case["status"], case["param"])
    if "says" in case:
        assert case["says"].lower() in error["message"].lower(), error
    wait_idle(client)  # refused before anything was queued
    tiny = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    served = post(base, "/v1/chat/completions", json.dumps(tiny).encode())
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["completion_tokens"] == 1


def test_an_unknown_route_gets_an_openai_error(system):
    _, client, base = system
    error = assert_openai_error(post(base, "/v1/nope", b'{"prompt": "hi"}'), 404, None)
    assert "route" in error["message"]


def test_an_unknown_tenant_is_refused(system):
    """Refused by admission control when submitted (so not in the corpus, whose param it
    does not name yet), before anything is queued."""
    _, client, base = system
    response = post(base, "/v1/completions", b'{"prompt": "hi", "tenant": "mallory"}')
    assert response.status_code == 400 and "tenant" in response.json()["error"]["message"]
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert_healthy(client)


def test_without_max_tokens_a_request_runs_to_the_remaining_context(system):
    """As OpenAI and vLLM: a chat runs to max_model_len; a completion's default of 16 tokens
    and a gRPC request's are cut to what the prompt leaves (refused only when asked for)."""
    _, client, base = system
    chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    usage = post(base, "/v1/chat/completions", json.dumps(chat).encode()).json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_LEN
    long_prompt = [5] * (MAX_LEN - 4)
    completion = {"prompt": long_prompt, "ignore_eos": True}
    response = post(base, "/v1/completions", json.dumps(completion).encode())
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    result = client.generate(token_ids=long_prompt, ignore_eos=True)
    assert result.finish_reason == "length" and len(result.token_ids) == 4
    wait_idle(client)


def test_after_the_corpus_nothing_is_queued_or_held(system):
    _, client, _ = system
    assert_healthy(client)
