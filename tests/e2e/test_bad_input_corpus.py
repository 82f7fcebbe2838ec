"""A corpus of hostile and broken input over gRPC and HTTP. Each case gets the documented
status and a sentence; afterwards the service still serves and no KV block is held."""

from __future__ import annotations

import json
import math
import time

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


def assert_healthy(client: SplitserveClient) -> None:
    result = client.generate(token_ids=[11, 12, 13], max_tokens=2, ignore_eos=True)
    assert result.finish_reason == "length"
    deadline = time.monotonic() + 10
    while True:
        info = client.server_info()
        idle = info.num_requests_in_flight == 0
        if idle and all(w.num_free_blocks == w.num_blocks for w in info.workers):
            return
        assert time.monotonic() < deadline, f"blocks held or requests stuck: {info}"
        time.sleep(0.02)


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


HI = [{"role": "user", "content": "hi"}]
F = {"name": "f"}
TOOL = {"type": "function", "function": F}
BAD_NAME = {"type": "function", "function": {"name": "no spaces please"}}
OTHER = {"type": "function", "function": {"name": "g"}}
WITH_TOOL = {"messages": HI, "tools": [TOOL]}
CALLS = {"content": "x", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}

HTTP_CASES = [
    ("/v1/completions", b"{not json", 400, "json"),
    ("/v1/completions", b'\xff\xfe{"prompt": 1}', 400, ""),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400, "n must be in [1, 16]"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n must be in [1, 16]"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 1}, 400, "best_of"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "needs content"),
    ("/v1/completions", {"prompt": ""}, 400, "empty"),
    ("/v1/completions", {"prompt": [5] * (MAX_LEN + 1)}, 400, "max_model_len"),
    ("/v1/completions", {"prompt": [VOCAB + 5]}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-17"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": True}, 400, "frobnicate"),
    ("/v1/completions", {"prompt": "hi", "tenant": "mallory"}, 400, "tenant"),
    ("/v1/completions", {"prompt": "hi", "priority": 10**12}, 400, "priority"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function"}]}, 400, "tools.0"),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"function": F}]}, 400, "tools.0.type"),
    ("/v1/chat/completions", {"messages": HI, "tools": "all"}, 400, "tools"),
    ("/v1/chat/completions", {"messages": HI, "tools": [BAD_NAME]}, 400, "letters"),
    ("/v1/chat/completions", {"messages": HI, "tools": [TOOL, TOOL]}, 400, "twice"),
    ("/v1/chat/completions", {"messages": HI, "tool_choice": "required"}, 400, "needs tools"),
    ("/v1/chat/completions", {**WITH_TOOL, "tool_choice": 7}, 400, "tool_choice"),
    ("/v1/chat/completions", {**WITH_TOOL, "tool_choice": OTHER}, 400, "not in"),
    (
        "/v1/chat/completions",
        {**WITH_TOOL, "tool_choice": "required", "guided_regex": "a"},
        400,
        "combined",
    ),
    ("/tokenize", {"prompt": "hi", "messages": HI}, 400, "either prompt or messages"),
    ("/detokenize", {"tokens": [VOCAB + 5]}, 400, "vocabulary"),
    ("/v1/chat/completions", {"messages": [{"role": "user", **CALLS}]}, 400, "assistant"),
    ("/v1/nope", {"prompt": "hi"}, 404, "route"),
]


@pytest.mark.parametrize(
    "path,body,status,needle", HTTP_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(HTTP_CASES)]
)
def test_http_bad_input(system, path, body, status, needle):
    _, client, base = system
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        base + path, content=content, headers={"content-type": "application/json"}, timeout=30
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and needle.lower() in error["message"].lower(), error
    assert_healthy(client)
