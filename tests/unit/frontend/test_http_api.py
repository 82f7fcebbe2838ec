"""The HTTP app in-process: real tokenizer, fake workers (no model, no sockets)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from frontend_svc.http import create_app
from frontend_svc.http.build import build_chat, choices
from frontend_svc.http.protocol import ChatCompletionRequest
from frontend_svc.intake import Intake
from scheduler_svc.obs.dashboard_history import DashboardHistory
from scheduler_svc.obs.engine_observer import ObserverGroup
from scheduler_svc.obs.metrics import MetricsObserver
from tests.engine_fakes import (
    TOKENIZER_VOCAB,
    FakeWorker,
    http_context,
    make_engine,
    registration,
    run_session,
)
from tests.unit.frontend.http_harness import MODEL, TOK, expected_text, sse_events


def run(fn, workers: int = 1, api_key: str = "", **engine_overrides):
    async def main():
        engine = make_engine(TOKENIZER_VOCAB, **engine_overrides)
        intake = Intake(TOK, MODEL, {MODEL}, 512)
        metrics, history = MetricsObserver(engine), DashboardHistory(engine)
        engine.observer = ObserverGroup(metrics, history)
        ctx = http_context(engine, intake, api_key, metrics, history)
        sessions = [
            engine.attach(registration(f"w{i}"), FakeWorker(vocab_size=TOKENIZER_VOCAB))
            for i in range(workers)
        ]
        tasks = [asyncio.create_task(run_session(engine, s)) for s in sessions]
        transport = httpx.ASGITransport(app=create_app(ctx))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return await fn(client, ctx)
        finally:
            for s in sessions:
                s.mark_lost("test over")
            await asyncio.gather(*tasks)

    return asyncio.run(main())


def test_completion_not_streamed_counts_usage_and_text():
    async def body(client, ctx):
        r = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "Hello world", "max_tokens": 5, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        return r.json(), r.headers

    out, headers = run(body)
    ids = TOK.encode("Hello world")
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert headers["x-request-id"] == out["id"]
    assert out["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 5,
        "total_tokens": len(ids) + 5,
    }
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["text"] == expected_text(ids, 5)


def test_completion_with_token_ids_streams_chunks_usage_and_done():
    prompt = [100, 200, 300, 400]

    async def body(client, ctx):
        r = await client.post(
            "/v1/completions",
            json={
                "prompt": prompt,
                "max_tokens": 6,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.text)

    events = run(body)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["prompt_tokens"] == 4
    chunks = events[:-2]
    assert all(c["usage"] is None for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text(prompt, 6)


def test_chat_streamed_and_not_agree():
    messages = [{"role": "user", "content": "Say something"}]

    async def body(client, ctx):
        whole = await client.post(
            "/v1/chat/completions", json={"messages": messages, "max_tokens": 4}
        )
        streamed = await client.post(
            "/v1/chat/completions",
            json={"messages": messages, "max_completion_tokens": 4, "stream": True},
        )
        return whole.json(), sse_events(streamed.text)

    whole, events = run(body)
    ids = TOK.apply_chat_template(messages)
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"] == {
        "role": "assistant",
        "content": expected_text(ids, 4),
    }
    assert whole["usage"]["prompt_tokens"] == len(ids)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == whole["choices"][0]["message"]["content"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_stop_string_ends_the_completion_before_it():
    prompt = [11, 22, 33]
    full = expected_text(prompt, 12)
    stop = full[8:11]
    assert stop and stop in full

    async def body(client, ctx):
        r = await client.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": 12, "stop": [stop]}
        )
        return r.json()

    out = run(body)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop
    assert choice["text"] == full[: full.index(stop)]


@pytest.mark.parametrize(
    ("payload", "status", "needle"),
    [
        ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"prompt": "x", "n": 17}, 400, "n must be in [1, 16]"),
        ({"prompt": "x", "n": 3, "best_of": 2}, 400, "best_of must be in [n, 16]"),
        ({"prompt": "x", "n": 1, "best_of": 2, "stream": True}, 400, "cannot be streamed"),
        ({"prompt": "x", "max_tokenz": 3}, 400, "max_tokenz"),
        ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": ""}, 400, "empty"),
        ({"prompt": [10**6]}, 400, "outside the vocabulary"),
        ({"prompt": ["a", ""]}, 400, "prompt[1] is empty"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"prompt": "x", "model": "gpt-9"}, 404, "unknown model"),
        ({"prompt": list(range(20, 600))}, 400, "max_model_len"),
    ],
)
def test_bad_requests_get_openai_error_bodies(payload, status, needle):
    async def body(client, ctx):
        return await client.post("/v1/completions", json=payload)

    r = run(body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert needle in err["message"]
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert isinstance(err["code"], str) and err["code"]  # never the status as a number


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([{"role": "user"}], "messages[0]: a user message needs content"),
        ([{"role": "system", "content": "be brief"}, {"role": "user"}], "messages[1]"),
        ([{"role": "tool", "content": None}], "a tool message needs content"),
    ],
)
def test_a_chat_message_without_content_is_refused_not_run(messages, needle):
    async def body(client, ctx):
        r = await client.post("/v1/chat/completions", json={"messages": messages})
        return r, dict(ctx.scheduler.engine.requests)

    r, in_flight = run(body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == "invalid_request"
    assert err["param"].startswith("messages.")
    assert not in_flight


def test_invalid_json_unknown_route_and_models():
    async def body(client, ctx):
        bad = await client.post(
            "/v1/completions", content=b"{nope", headers={"content-type": "application/json"}
        )
        missing = await client.get("/v1/nothing")
        models = await client.get("/v1/models")
        one = await client.get(f"/v1/models/{MODEL}")
        other = await client.get("/v1/models/other")
        return bad, missing, models, one, other

    bad, missing, models, one, other = run(body)
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    assert missing.status_code == 404 and "/v1/completions" in missing.json()["error"]["message"]
    assert bad.json()["error"]["code"] == "invalid_request"
    assert missing.json()["error"]["code"] == "not_found"
    assert models.json()["data"][0]["id"] == MODEL
    assert one.json()["id"] == MODEL and one.json()["max_model_len"] == 512
    assert other.status_code == 404


def test_no_worker_is_503_and_ready_is_kept_apart_from_health():
    async def body(client, ctx):
        health = await client.get("/health")
        ready = await client.get("/ready")
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        s = await client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}
        )
        return health, ready, r, s

    health, ready, r, s = run(body, workers=0)
    assert health.status_code == 200
    assert ready.status_code == 503
    assert r.status_code == 503 and "no worker" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "service_unavailable_error"
    assert s.status_code == 503  # a stream that never started answers with a status, too


def test_ready_with_a_worker():
    async def body(client, ctx):
        return await client.get("/ready")

    r = run(body)
    assert r.status_code == 200 and r.json()["workers"] == ["w0"]


def test_api_key_guards_the_api_but_not_probes_metrics_or_dashboard():
    async def body(client, ctx):
        out = {}
        out["none"] = await client.get("/v1/models")
        out["wrong"] = await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        out["basic"] = await client.get("/v1/models", headers={"Authorization": "Basic abc"})
        out["right"] = await client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        out["post"] = await client.post("/v1/completions", json={"prompt": "x"})
        for path in ("/health", "/ready", "/metrics", "/dashboard", "/dashboard/api/state"):
            out[path] = await client.get(path)
        return out

    out = run(body, api_key="s3cret")
    for key in ("none", "wrong", "basic", "post"):
        assert out[key].status_code == 401, key
        assert out[key].json()["error"]["type"] == "authentication_error"
    assert "API key" in out["none"].json()["error"]["message"]
    assert out["right"].status_code == 200
    for path in ("/health", "/ready", "/metrics", "/dashboard", "/dashboard/api/state"):
        assert out[path].status_code == 200, path


def metric_values(text: str) -> dict:
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()))
            values[key] = s.value
    return values


def test_metrics_move_with_requests():
    async def body(client, ctx):
        before = metric_values((await client.get("/metrics")).text)
        for i in range(3):
            r = await client.post(
                "/v1/completions", json={"prompt": [5, 6, 7 + i], "max_tokens": 4 + i}
            )
            assert r.status_code == 200
        await client.post("/v1/completions", json={"prompt": "x", "temperature": -1})
        after = metric_values((await client.get("/metrics")).text)
        return before, after

    before, after = run(body)

    def delta(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("splitserve:generation_tokens_total") == 4 + 5 + 6
    assert delta("splitserve:prompt_tokens_total") == 9
    assert delta("splitserve:time_to_first_token_seconds_count") == 3
    assert delta("splitserve:e2e_request_latency_seconds_count") == 3
    assert delta("splitserve:request_queue_time_seconds_count") == 3
    assert delta("splitserve:inter_token_latency_seconds_count") == 3 + 4 + 5
    assert delta("splitserve:request_success_total|finished_reason=length") == 3
    assert delta("splitserve:request_rejected_total|reason=invalid") == 1
    assert after["splitserve:workers_attached"] == 1
    assert after["splitserve:kv_cache_usage_perc|worker=w0"] == 0.0
    assert after["splitserve:num_requests_running|worker=w0"] == 0
    assert after["splitserve:num_preemptions_total|worker=w0"] == 0
    assert after["splitserve:step_time_seconds_count|worker=w0"] > 0
    # speculative decoding is off here: its counters exist per worker, at 0
    assert after["splitserve:spec_decode_num_draft_tokens_total|worker=w0"] == 0
    assert after["splitserve:spec_decode_num_accepted_tokens_total|worker=w0"] == 0


def test_dashboard_state_has_the_worker_and_its_step_history():
    async def body(client, ctx):
        await client.post("/v1/completions", json={"prompt": list(range(40, 80)), "max_tokens": 3})
        page = await client.get("/dashboard")
        state = (await client.get("/dashboard/api/state")).json()
        return page, state

    page, state = run(body)
    assert page.status_code == 200 and "<canvas" not in page.text  # canvases are made by JS
    assert "/dashboard/api/state" in page.text
    (w,) = state["workers"]
    assert w["worker_id"] == "w0" and w["num_total_blocks"] == 64
    assert w["spec_draft_tokens"] == w["spec_accepted_tokens"] == 0  # speculation off
    hist = w["history"]
    assert sum(hist["prefill"]) == 40 and sum(hist["decode"]) == 2
    assert len(hist["t"]) == len(hist["kv"]) == len(hist["running"])


def test_client_disconnect_mid_stream_drops_the_request():
    """Drive the ASGI app by hand: read one chunk, then hang up."""

    async def body(client, ctx):
        app = client._transport.app  # noqa: SLF001
        payload = json.dumps({"prompt": [1, 2, 3], "max_tokens": 400, "stream": True}).encode()
        hang_up = asyncio.Event()
        sent = []

        async def receive():
            if not sent:
                sent.append(1)
                return {"type": "http.request", "body": payload, "more_body": False}
            await hang_up.wait()
            return {"type": "http.disconnect"}

        chunks = []

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                chunks.append(message["body"])
                hang_up.set()

        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/completions",
            "raw_path": b"/v1/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2),
        }
        await asyncio.wait_for(app(scope, receive, send), 10)
        for _ in range(100):
            if not ctx.scheduler.engine.requests:
                break
            await asyncio.sleep(0.01)
        session = ctx.scheduler.engine.sessions["w0"]
        await asyncio.sleep(0.05)
        return chunks, ctx.scheduler.engine.requests, session.scheduler.stats()

    chunks, in_flight, stats = run(body)
    assert chunks and not in_flight
    assert stats.num_running == 0 and stats.num_used_blocks == 0
    tokens = sum(len(sse_events(c.decode())) for c in chunks)
    assert tokens < 400


def test_infinite_logprobs_become_finite_json():
    from common.convert import TokenLogprobs
    from frontend_svc.client_request import StreamDelta
    from frontend_svc.http.format import ResponseFormatter

    fmt = ResponseFormatter(True, "id", MODEL, 3, TOK, want_logprobs=True)
    delta = StreamDelta(
        [42], "x", logprobs=[TokenLogprobs(42, float("-inf"), [(42, float("nan"))])]
    )
    body = json.dumps(fmt.chunk(delta), allow_nan=False)  # would raise on inf / nan
    assert "-9999.0" in body


PROMPT_40 = list(range(100, 140))  # 10 blocks of 4 tokens (the fake workers' block size)


def test_n_choices_share_the_prompt_computed_once_and_count_it_once_in_usage():
    async def body(client, ctx):
        r = await client.post(
            "/v1/completions",
            json={"prompt": PROMPT_40, "n": 3, "max_tokens": 6, "temperature": 0},
        )
        await asyncio.sleep(0.05)
        (session,) = ctx.scheduler.engine.sessions.values()
        return r, session.scheduler.stats(), dict(ctx.scheduler.engine.requests)

    r, stats, in_flight = run(body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    texts = {c["text"] for c in out["choices"]}
    assert texts == {expected_text(PROMPT_40, 6)}  # greedy: the same text three times
    assert out["usage"] == {"prompt_tokens": 40, "completion_tokens": 18, "total_tokens": 58}
    # the first choice computes the 40 prompt tokens and its 5 fed-back outputs; each sibling
    # finds 9 of the 10 prompt blocks in the cache (a hit is capped so that the last prompt
    # token is computed) and computes only the last block's 4 tokens and its 5 outputs
    assert stats.prefix_cache_hits == 2 * 36
    assert stats.num_prefill_tokens + stats.num_decode_tokens == (40 + 5) + 2 * (4 + 5)
    assert stats.num_free_blocks == 64 and not in_flight


def test_n_streamed_chunks_carry_their_index_and_seeds_differ_per_choice():
    async def body(client, ctx):
        payload = {
            "messages": [{"role": "user", "content": "hi"}],
            "n": 2,
            "max_tokens": 8,
            "temperature": 1.0,
            "seed": 7,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return await client.post("/v1/chat/completions", json=payload)

    r = run(body)
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role")]
    assert sorted(roles) == [0, 1]  # the role chunk of each choice
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 16
    texts = ["", ""]
    for c in chunks:
        texts[c["choices"][0]["index"]] += c["choices"][0]["delta"].get("content", "")
    assert all(texts)


def test_each_choice_has_its_own_seed_and_waits_for_the_first_prompt():
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], n=3, seed=7, temperature=1.0
    )
    intake = Intake(TOK, MODEL, {MODEL}, 512)
    group = choices(intake, body, build_chat(intake, body))
    assert [s.params.seed for s in group] == [7, 8, 9]
    assert [s.prefill_after for s in group] == [None, group[0].request_id, group[0].request_id]
    assert len({s.request_id for s in group}) == 3
    assert len({id(s.detokenizer) for s in group}) == 3


def test_best_of_returns_the_n_most_likely_choices():
    async def body(client, ctx):
        return await client.post(
            "/v1/completions",
            json={"prompt": PROMPT_40, "n": 1, "best_of": 3, "max_tokens": 4, "seed": 1},
        )

    r = run(body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["choices"]) == 1 and out["choices"][0]["index"] == 0
    assert out["choices"][0]["logprobs"] is None  # asked for internally, not shown
    assert out["usage"]["completion_tokens"] == 12  # every generated choice counts


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("extra", "kind"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": SCHEMA},
                }
            },
            "json_schema",
        ),
        ({"guided_regex": "[a-z]+"}, "regex"),
        ({"guided_choice": ["yes", "no"]}, "choice"),
        ({"guided_json": SCHEMA}, "json_schema"),
        ({"structured_outputs": {"grammar": 'start: "a" | "b"'}}, "grammar"),
        ({"response_format": {"type": "text"}}, None),
    ],
)
def test_constraints_reach_the_sampling_params(extra, kind):
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **extra)
    state = build_chat(Intake(TOK, MODEL, {MODEL}, 512), body)
    got = state.params.structured
    assert (got.kind if got else None) == kind
    if kind == "json_schema":
        assert json.loads(got.spec) == SCHEMA


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
            "type must be",
        ),
        ({"guided_regex": "(("}, "regex is not valid"),
        ({"guided_choice": []}, "choice needs 1 to"),
        ({"response_format": {"type": "yaml"}}, "not supported"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "one output constraint"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "exactly one of"),
        ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_a_bad_constraint_is_a_400_with_the_reason(extra, needle):
    async def body(client, ctx):
        payload = {"messages": [{"role": "user", "content": "hi"}], **extra}
        return await client.post("/v1/chat/completions", json=payload), dict(
            ctx.scheduler.engine.requests
        )

    r, in_flight = run(body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"] and not in_flight


def test_a_grammar_compiles_beside_the_event_loop(monkeypatch):
    import threading

    from common import structured

    compiled_on = []
    check = structured.check

    def recording(*args, **kwargs):
        compiled_on.append(threading.current_thread())
        return check(*args, **kwargs)

    monkeypatch.setattr(structured, "check", recording)

    async def body(client, ctx):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
        chat = {"messages": [{"role": "user", "content": "hi"}], "response_format": fmt}
        r = await client.post("/v1/chat/completions", json={**chat, "max_tokens": 2})
        assert r.status_code == 200, r.text
        r = await client.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "guided_regex": "(("}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text
        return ctx.metrics

    run(body)
    assert len(compiled_on) == 2
    assert all(t is not threading.main_thread() for t in compiled_on)
