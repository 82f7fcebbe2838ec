"""Predicted Outputs through the HTTP API in-process (real tokenizer, fake workers): the
prediction reaches the scheduler and drafts with speculation off, the text is unchanged, usage
counts the prediction's tokens, and what is not text (or too long) is a 400."""

from __future__ import annotations

from common.convert import HandleTable, encode_step, sampling_from_proto, sampling_to_proto
from common.messages import NewRequestData, SamplingParams, SchedulerOutput
from frontend_svc.http.prediction import prediction_counts
from tests.unit.frontend.test_http_api import MODEL, TOK, metric_values, run, sse_events

DRAFTED = "splitserve:spec_decode_num_draft_tokens_total|worker=w0"


def test_the_prediction_travels_to_the_scheduler_but_not_to_a_worker():
    params = SamplingParams(max_tokens=4, prediction=(5, 6, 7))
    back, _ = sampling_from_proto(sampling_to_proto(params))
    assert back.prediction == (5, 6, 7)
    assert sampling_from_proto(sampling_to_proto(SamplingParams()))[0].prediction == ()
    new = NewRequestData("r", [1, 2], params, [0], 0)
    step = SchedulerOutput(new_requests=[new], num_scheduled_tokens={"r": 2})
    sent = encode_step(step, HandleTable())
    assert list(sent.new_requests[0].sampling.prediction_token_ids) == []


def test_prediction_counts_follow_openais_definition():
    assert prediction_counts((1, 2, 3, 4), (1, 2, 3, 4)) == (4, 0)
    assert prediction_counts((1, 2, 3, 4), (1, 9, 3, 4, 5)) == (3, 1)
    assert prediction_counts((), (1, 2)) == (0, 0)


def test_a_prediction_drafts_keeps_the_text_and_shows_in_usage():
    async def body(client, ctx):
        ask = {"model": MODEL, "prompt": "Hello world", "max_tokens": 12, "temperature": 0}
        plain = (await client.post("/v1/completions", json=ask)).json()
        before = metric_values((await client.get("/metrics")).text)
        text = plain["choices"][0]["text"]
        prediction = {"type": "content", "content": text}
        predicted = await client.post("/v1/completions", json={**ask, "prediction": prediction})
        chat = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 6,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "prediction": {"type": "content", "content": [{"type": "text", "text": "a b"}]},
        }
        streamed = await client.post("/v1/chat/completions", json=chat)
        after = metric_values((await client.get("/metrics")).text)
        return plain, predicted.json(), streamed, after.get(DRAFTED, 0) - before.get(DRAFTED, 0)

    plain, predicted, streamed, drafted = run(body)
    assert predicted["choices"][0]["text"] == plain["choices"][0]["text"]
    assert "completion_tokens_details" not in plain["usage"]
    details = predicted["usage"]["completion_tokens_details"]
    size = len(TOK.encode(plain["choices"][0]["text"], add_special_tokens=False))
    assert details["accepted_prediction_tokens"] > 0
    assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] == size
    assert drafted > 0  # speculation is off for this server: the prediction drafted
    assert streamed.status_code == 200
    last = [e for e in sse_events(streamed.text) if e != "[DONE]"][-1]
    assert set(last["usage"]["completion_tokens_details"]) == {
        "accepted_prediction_tokens",
        "rejected_prediction_tokens",
    }


def test_a_prediction_that_is_not_text_or_too_long_is_a_400():
    async def body(client, ctx):
        base = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        bodies = {
            "type": {"type": "image", "content": "x"},
            "part": {"type": "content", "content": [{"type": "image_url", "image_url": {}}]},
            "shape": {"type": "content", "content": 5},
            "long": {"type": "content", "content": "word " * 2000},
        }
        out = {}
        for name, prediction in bodies.items():
            r = await client.post("/v1/chat/completions", json={**base, "prediction": prediction})
            out[name] = (r.status_code, r.json()["error"])
        return out

    out = run(body)
    assert all(status == 400 for status, _ in out.values()), out
    assert out["type"][1]["param"] == "prediction.type"
    assert out["part"][1]["param"] == "prediction.content.0"
    assert out["long"][1]["param"] == "prediction"
    assert "max_model_len" in out["long"][1]["message"]
