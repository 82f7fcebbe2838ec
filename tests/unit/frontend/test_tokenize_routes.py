"""POST /tokenize and /detokenize (vLLM's shape) on the in-process HTTP app, real tokenizer."""

from __future__ import annotations

from tests.unit.frontend.test_http_api import MODEL, TOK, run

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _post(path: str, payload: dict):
    async def body(client, ctx):
        r = await client.post(path, json=payload)
        return r.status_code, r.json()

    return run(body)


def test_tokenize_a_prompt_as_the_completion_endpoint_does():
    status, out = _post("/tokenize", {"model": MODEL, "prompt": "Hello world"})
    assert status == 200, out
    assert out["tokens"] == TOK.encode("Hello world")
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 512
    assert out["token_strs"] is None
    status, out = _post("/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert "".join(out["token_strs"]) == TOK.decode(out["tokens"], skip_special_tokens=False)


def test_tokenize_messages_as_the_chat_endpoint_renders_them():
    status, out = _post("/tokenize", {"messages": MESSAGES})
    assert status == 200, out
    assert out["tokens"] == TOK.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert TOK.decode(out["tokens"], skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    _, without = _post("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert without["tokens"] == out["tokens"][: without["count"]]
    assert without["count"] < out["count"]
    _, with_tools = _post("/tokenize", {"messages": MESSAGES, "tools": [WEATHER]})
    text = TOK.decode(with_tools["tokens"], skip_special_tokens=False)
    assert "get_weather" in text and with_tools["count"] > out["count"]


def test_detokenize_round_trips_and_bad_bodies_are_400s():
    ids = TOK.encode("The capital of France is Paris.")
    status, out = _post("/detokenize", {"model": MODEL, "tokens": ids})
    assert status == 200 and out == {"prompt": "The capital of France is Paris."}
    for path, payload, param in [
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]}, None),
    ]:
        status, out = _post(path, payload)
        assert status == 400, (path, payload, out)
        assert isinstance(out["error"]["message"], str) and out["error"]["code"] is not None
        if param is not None:
            assert out["error"]["param"] == param, out
    status, out = _post("/tokenize", {"model": "gpt-17", "prompt": "a"})
    assert status == 404 and out["error"]["param"] == "model"
