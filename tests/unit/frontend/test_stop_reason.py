"""`stop_reason` as vLLM gives it: null on EOS and on length, the token id when one of the
request's stop_token_ids stopped it, the string when a stop string did; on both endpoints,
streamed and not. gRPC carries the same as text ("" for null)."""

from __future__ import annotations

import pytest

from common.outcomes import FinishReason
from frontend_svc.client_request import StreamDelta
from frontend_svc.generation_service import delta_to_proto
from tests.unit.frontend.http_harness import TOK, ScriptedWorker, post, sse_events

EOS = TOK.eos_token_id
SCRIPT = [300, 301, 302, 303, 304, 305, EOS]  # six tokens, then EOS
TEXT = TOK.decode(SCRIPT[:-1])
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def final_choice(path: str, stream: bool, **fields) -> dict:
    """The choice that carries the finish reason (the last chunk's, streamed)."""
    if path == "/v1/completions":
        payload = {"prompt": [10, 11, 12]}
    else:
        payload = {"messages": [{"role": "user", "content": "Count."}]}
    payload.update({"max_tokens": 20, "stream": stream, **fields})
    response = post(path, payload, ScriptedWorker(lambda prompt: SCRIPT))
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()["choices"][0]
    chunks = [e for e in sse_events(response.text) if e != "[DONE]"]
    choices = [c["choices"][0] for c in chunks]
    ends = [c for c in choices if c["finish_reason"] is not None]
    assert len(ends) == 1 and choices[-1] is ends[0]
    assert all("stop_reason" not in c for c in choices[:-1])
    return ends[0]


def output_text(choice: dict) -> str:
    if "text" in choice:
        return choice["text"]
    return (choice.get("message") or choice.get("delta") or {}).get("content") or ""


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ENDPOINTS)
def test_eos_gives_finish_stop_and_a_null_stop_reason(path, stream):
    choice = final_choice(path, stream)
    assert choice["finish_reason"] == "stop"
    assert "stop_reason" in choice and choice["stop_reason"] is None


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ENDPOINTS)
def test_a_stop_token_id_is_the_stop_reason_as_an_integer(path, stream):
    choice = final_choice(path, stream, stop_token_ids=[302])
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == 302 and isinstance(choice["stop_reason"], int)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ENDPOINTS)
def test_a_stop_string_is_the_stop_reason_as_a_string(path, stream):
    stop = TEXT[5:8]
    assert stop and TEXT.index(stop) == 5
    choice = final_choice(path, stream, stop=[stop])
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop
    if not stream:
        assert output_text(choice) == TEXT[:5]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ENDPOINTS)
def test_length_gives_a_null_stop_reason(path, stream):
    choice = final_choice(path, stream, max_tokens=3)
    assert choice["finish_reason"] == "length"
    assert "stop_reason" in choice and choice["stop_reason"] is None


def test_eos_among_the_stop_token_ids_still_reads_as_eos():
    """The scheduler checks EOS before stop_token_ids, as vLLM does: EOS it is."""
    choice = final_choice("/v1/completions", False, stop_token_ids=[EOS])
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None


def test_with_ignore_eos_a_listed_eos_is_a_stop_token():
    choice = final_choice("/v1/completions", False, stop_token_ids=[EOS], ignore_eos=True)
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == EOS


@pytest.mark.parametrize(("stop_reason", "wire"), [(None, ""), (302, "302"), ("</s>", "</s>")])
def test_grpc_sends_the_stop_reason_as_text_and_nothing_for_eos(stop_reason, wire):
    delta = StreamDelta([5], "x", FinishReason.STOP, stop_reason, num_output_tokens=1)
    assert delta_to_proto("r", 3, delta).stop_reason == wire
