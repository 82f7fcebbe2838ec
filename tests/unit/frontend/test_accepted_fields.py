"""The fields apps send that only label or route a request are accepted and change nothing;
those the server cannot honour are refused with a sentence naming them; vLLM's
include_stop_str_in_output keeps the matched stop string in the text."""

from __future__ import annotations

import openai
import pytest

from tests.unit.frontend.http_harness import (
    ScriptedWorker,
    expected_text,
    post,
    says,
    serve,
    sse_events,
)

USER = [{"role": "user", "content": "Say hello."}]
LABELS = dict(
    user="u-1",
    metadata={"app": "notes"},
    store=False,
    service_tier="auto",
    safety_identifier="hash-of-user",
    prompt_cache_key="notes-v1",
    prompt_cache_retention="24h",
    modalities=["text"],
)


def test_labels_and_routing_hints_are_accepted_and_change_nothing():
    worker = ScriptedWorker(says("Hello there"))

    async def fn(http, oai):
        plain = await oai.chat.completions.create(model="fake", messages=USER, temperature=0)
        labelled = await oai.chat.completions.create(
            model="fake",
            messages=USER,
            temperature=0,
            extra_body={"prompt_cache_options": {"ttl": "30m"}},
            **LABELS,
        )
        streamed = await oai.chat.completions.create(
            model="fake",
            messages=USER,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "include_obfuscation": True},
            **LABELS,
        )
        chunks = [chunk async for chunk in streamed]
        return plain, labelled, chunks

    plain, labelled, chunks = serve(fn, worker)
    assert plain.choices[0].message.content == "Hello there"
    assert labelled.choices[0].message.content == "Hello there"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello there"
    assert len(worker.prompts) == 3 and len(set(worker.prompts)) == 1  # the same prompt


def test_completions_take_user():
    response = post("/v1/completions", {"prompt": [10, 11], "max_tokens": 3, "user": "u-1"})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected_text([10, 11], 3)


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"modalities": ["text", "audio"]}, "modalities", "text only"),
        ({"modalities": ["audio"]}, "modalities", "text only"),
        ({"web_search_options": {}}, "web_search_options", "cannot search the web"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "text only"),
        ({"moderation": {}}, "moderation", "no moderation"),
    ],
)
def test_fields_that_cannot_be_honoured_are_refused_naming_them(fields, param, needle):
    response = post("/v1/chat/completions", {"messages": USER, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"], error


def test_the_official_client_sees_a_refusal_as_bad_request():
    async def fn(http, oai):
        with pytest.raises(openai.BadRequestError) as err:
            await oai.chat.completions.create(
                model="fake", messages=USER, web_search_options={"search_context_size": "low"}
            )
        return err.value.body

    body = serve(fn)
    assert body["param"] == "web_search_options"


# ---- include_stop_str_in_output -------------------------------------------------------------
PROMPT = [11, 22, 33]
FULL = expected_text(PROMPT, 12)
STOP = FULL[8:11]


def completion_texts(payload: dict) -> dict[int, str]:
    response = post("/v1/completions", payload)
    assert response.status_code == 200, response.text
    if not payload.get("stream"):
        return {c["index"]: c["text"] for c in response.json()["choices"]}
    texts: dict[int, str] = {}
    for event in sse_events(response.text):
        if event != "[DONE]":
            for c in event["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    return texts


@pytest.mark.parametrize("stream", [False, True])
def test_completion_keeps_the_stop_string_when_asked(stream):
    assert STOP and FULL.index(STOP) == 8
    base = {"prompt": PROMPT, "max_tokens": 12, "stop": [STOP], "stream": stream}
    assert completion_texts(base) == {0: FULL[:8]}
    kept = completion_texts({**base, "include_stop_str_in_output": True})
    assert kept == {0: FULL[:11]} and kept[0].endswith(STOP)


def test_every_choice_keeps_the_stop_string():
    payload = {"prompt": PROMPT, "max_tokens": 12, "stop": [STOP], "n": 2}
    texts = completion_texts({**payload, "include_stop_str_in_output": True})
    assert texts == {0: FULL[:11], 1: FULL[:11]}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_keeps_the_stop_string_when_asked(stream):
    worker = ScriptedWorker(says("The answer is 42. Done."))
    payload = {
        "messages": USER,
        "stop": ["42"],
        "include_stop_str_in_output": True,
        "stream": stream,
    }
    response = post("/v1/chat/completions", payload, worker)
    assert response.status_code == 200, response.text
    if stream:
        events = [e for e in sse_events(response.text) if e != "[DONE]"]
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
        last = events[-1]["choices"][0]
    else:
        last = response.json()["choices"][0]
        text = last["message"]["content"]
    assert text == "The answer is 42"
    assert last["finish_reason"] == "stop" and last["stop_reason"] == "42"
