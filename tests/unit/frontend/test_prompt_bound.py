"""The length check before tokenizing: a sound lower bound on the token count (never over the
true count on the default tokenizer), a far-over text refused on every path without being
tokenized, and tokenization run beside the event loop."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.pb import generation_pb2 as pb
from common.pb import sampling_pb2
from common.tokenizer import Tokenizer
from frontend_svc.generation_service import GenerationService
from frontend_svc.intake import Intake
from scheduler_svc.core import RequestRejected
from tests.engine_fakes import make_engine
from tests.unit.frontend.test_http_api import MODEL, TOK, run

MAX_LEN = 512  # test_http_api's Intake
FAR_OVER = "word " * 20_000  # 100 kB: at least 1235 tokens by the bound alone
OVER_BY_COUNT = "hello " * 600  # 600 tokens, but only 45 by the bound: counted, then refused
CORPUS = [
    "The capital of France is Paris.",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\r\n",
    "多字节字符：你好，世界。日本語のテキスト、한국어 텍스트",
    "emoji 🙂🚀👩‍👩‍👧 café naïve Ελληνικά русский",
    ("\n" + " " * 80) * 50,  # the vocabulary's longest token, over and over
    "#" * 4000 + "=" * 3000 + "-" * 2000,
    "<|im_start|>user\nhi<|im_end|>\n" * 40 + "<|endoftext|>" * 40,
    " " * 10_000,
    "\x00\x01\x7f" * 300,
    "\x16" * 5000 + "a",  # dropped by the tokenizer
    "\U00040000\U00080000" * 500,  # lead bytes with no token of their own
]


def bound(text: str) -> int:
    return TOK.length_bound().least_tokens(text)


def test_the_default_tokenizer_has_a_bound_its_longest_token_and_dropped_bytes():
    length_bound = TOK.length_bound()
    pieces = TOK.byte_pieces().pieces
    assert length_bound.longest == max(len(p) for p in pieces) > 4
    assert len(TOK.encode(("\n" + " " * 80) * 10, add_special_tokens=False)) >= 10
    # a control character with no token of its own is dropped: it counts for nothing
    assert b"\x16" in length_bound.dropped and TOK.encode("\x16", add_special_tokens=False) == []


@pytest.mark.parametrize("text", CORPUS)
def test_the_bound_is_never_over_the_true_count(text):
    assert bound(text) <= len(TOK.encode(text, add_special_tokens=False))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=3000))
def test_the_bound_is_never_over_the_true_count_on_any_text(text):
    assert bound(text) <= len(TOK.encode(text, add_special_tokens=False))


def test_the_bound_holds_on_a_rendered_chat():
    messages = [{"role": "user", "content": text} for text in CORPUS]
    text = TOK.apply_chat_template(messages, tokenize=False)
    assert bound(text) <= len(TOK.encode(text, add_special_tokens=False))


@pytest.fixture
def encoded(monkeypatch) -> list[tuple[int, threading.Thread]]:
    """Each text the tokenizer encodes: its length and the thread that encoded it."""
    calls: list[tuple[int, threading.Thread]] = []
    encode = Tokenizer.encode

    def spy(self, text, add_special_tokens=True):
        calls.append((len(text), threading.current_thread()))
        return encode(self, text, add_special_tokens)

    monkeypatch.setattr(Tokenizer, "encode", spy)
    return calls


WEATHER = {"type": "function", "function": {"name": "f", "description": FAR_OVER}}
HTTP_CASES = [
    ("/v1/completions", {"prompt": FAR_OVER, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [FAR_OVER], "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": FAR_OVER}]}, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]},
        "messages",
    ),
    ("/tokenize", {"prompt": FAR_OVER}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": FAR_OVER}]}, "messages"),
]


@pytest.mark.parametrize(("path", "payload", "param"), HTTP_CASES)
def test_a_far_over_text_is_refused_over_http_without_tokenizing(encoded, path, payload, param):
    async def body(client, ctx):
        return await client.post(path, json={"model": MODEL, **payload})

    r = run(body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert "at least" in error["message"] and f"max_model_len is {MAX_LEN}" in error["message"]
    assert not [n for n, _ in encoded if n > 1000]


class Aborted(Exception):
    pass


class FakeContext:
    async def abort(self, code, message):
        raise Aborted(code, message)

    def set_trailing_metadata(self, metadata) -> None:
        pass


def generate(request: pb.GenerateRequest) -> tuple:
    async def main():
        service = GenerationService(make_engine().client, Intake(TOK, MODEL, {MODEL}, MAX_LEN))
        with pytest.raises(Aborted) as info:
            async for _ in service.Generate(request, FakeContext()):
                pass
        return info.value.args

    return asyncio.run(main())


def test_a_far_over_text_is_refused_over_grpc_without_tokenizing(encoded):
    sampling = sampling_pb2.SamplingParams(max_tokens=2)
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=FAR_OVER)])
    for request in (
        pb.GenerateRequest(text=FAR_OVER, sampling=sampling),
        pb.GenerateRequest(chat=chat, sampling=sampling),
    ):
        code, message = generate(request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len" in message
    assert not [n for n, _ in encoded if n > 1000]


def test_a_text_the_bound_lets_through_is_counted_and_refused_alike(encoded):
    intake = Intake(TOK, MODEL, {MODEL}, MAX_LEN)
    with pytest.raises(RequestRejected, match=r"the prompt has \d+ tokens but max_model_len"):
        intake.build(pb.GenerateRequest(text=OVER_BY_COUNT))
    assert encoded and encoded[-1][0] == len(OVER_BY_COUNT)


def test_tokenizing_runs_beside_the_event_loop(encoded):
    async def body(client, ctx):
        chat = {"messages": [{"role": "user", "content": OVER_BY_COUNT}]}
        return [
            await client.post("/v1/completions", json={"prompt": OVER_BY_COUNT}),
            await client.post("/v1/chat/completions", json=chat),
            await client.post("/tokenize", json={"prompt": "Hello world"}),
            await client.post("/tokenize", json=chat),
        ]

    statuses = [r.status_code for r in run(body)]
    assert statuses == [400, 400, 200, 200]  # the first two counted over max_model_len
    code, _ = generate(pb.GenerateRequest(text=OVER_BY_COUNT))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(encoded) == 5
    assert all(thread is not threading.main_thread() for _, thread in encoded)
