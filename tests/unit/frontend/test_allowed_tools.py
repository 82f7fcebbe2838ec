"""tool_choice `allowed_tools` (only the named tools can be called; `required`: one must be)
and the legacy `functions` / `function_call`, read as tools and answered as `function_call`."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion

from frontend_svc.http.build import build_chat
from frontend_svc.http.protocol import ChatCompletionRequest
from frontend_svc.intake import Intake
from tests.unit.frontend.http_harness import TOK, ScriptedWorker, post, says, serve, sse_events

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}
USER = [{"role": "user", "content": "What time is it in Paris?"}]
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'


def allowed(mode: str, *names: str) -> dict:
    tools = [{"type": "function", "function": {"name": name}} for name in names]
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}}


def chat(reply: str, payload: dict) -> tuple[ChatCompletion, ScriptedWorker]:
    worker = ScriptedWorker(says(reply))
    response = post("/v1/chat/completions", {"messages": USER, **payload}, worker)
    assert response.status_code == 200, response.text
    return ChatCompletion.model_validate(response.json()), worker


def constraint_spec(payload: dict) -> str:
    body = ChatCompletionRequest.model_validate({"messages": USER, **payload})
    state = build_chat(Intake(TOK, "fake", {"fake"}, 512), body)
    assert state.params.structured is not None
    return state.params.structured.spec


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_the_model_is_shown_and_may_call_only_the_allowed_tools(mode):
    completion, worker = chat(
        TIME_CALL, {"tools": [WEATHER, CLOCK], "tool_choice": allowed(mode, "get_time")}
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_time", {"zone": "CET"})]
    assert '"name": "get_time"' in worker.prompts[0]
    assert "get_weather" not in worker.prompts[0]


def test_required_constrains_the_output_to_the_allowed_tools():
    spec = constraint_spec(
        {"tools": [WEATHER, CLOCK], "tool_choice": allowed("required", "get_time")}
    )
    assert "get_time" in spec and "get_weather" not in spec
    both = constraint_spec(
        {"tools": [WEATHER, CLOCK], "tool_choice": allowed("required", "get_time", "get_weather")}
    )
    assert "get_time" in both and "get_weather" in both


def test_auto_with_allowed_tools_may_answer_in_text():
    completion, _ = chat(
        "It is noon.", {"tools": [WEATHER, CLOCK], "tool_choice": allowed("auto", "get_time")}
    )
    assert completion.choices[0].finish_reason == "stop"
    assert completion.choices[0].message.content == "It is noon."


def test_the_flat_tool_shape_is_accepted_and_the_official_client_sends_the_choice():
    worker = ScriptedWorker(says(TIME_CALL))
    choice = {
        "type": "allowed_tools",
        "allowed_tools": {"mode": "required", "tools": [{"type": "function", "name": "get_time"}]},
    }

    async def fn(http, oai):
        return await oai.chat.completions.create(
            model="fake", messages=USER, tools=[WEATHER, CLOCK], tool_choice=choice
        )

    completion = serve(fn, worker)
    assert completion.choices[0].message.tool_calls[0].function.name == "get_time"
    assert "get_weather" not in worker.prompts[0]


@pytest.mark.parametrize(
    ("tool_choice", "param", "needle"),
    [
        (allowed("required", "get_date"), "tool_choice.allowed_tools.tools.0", "not in tools"),
        (allowed("auto", "get_time", "nope"), "tool_choice.allowed_tools.tools.1", "'nope'"),
        (allowed("required"), "tool_choice.allowed_tools.tools", "empty"),
        (allowed("sometimes", "get_time"), "tool_choice.allowed_tools", "mode"),
        ({"type": "allowed_tools"}, "tool_choice.allowed_tools", "mode"),
        (
            {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"name": 1}]}},
            "tool_choice.allowed_tools.tools.0",
            "must be",
        ),
    ],
)
def test_bad_allowed_tools_are_refused_naming_the_entry(tool_choice, param, needle):
    response = post(
        "/v1/chat/completions",
        {"messages": USER, "tools": [WEATHER, CLOCK], "tool_choice": tool_choice},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"], error


# ---- the legacy functions / function_call ---------------------------------------------------
FUNCTIONS = [WEATHER["function"], CLOCK["function"]]


def test_a_named_function_call_is_answered_as_function_call():
    worker = ScriptedWorker(says('{"city": "Paris"}'))

    async def fn(http, oai):
        return await oai.chat.completions.create(
            model="fake", messages=USER, functions=FUNCTIONS, function_call={"name": "get_weather"}
        )

    completion = serve(fn, worker)
    choice = completion.choices[0]
    assert choice.finish_reason == "function_call"
    assert choice.message.tool_calls is None
    assert choice.message.function_call.name == "get_weather"
    assert json.loads(choice.message.function_call.arguments) == {"city": "Paris"}
    assert '"name": "get_time"' in worker.prompts[0]  # every function is shown


def test_a_streamed_auto_call_comes_as_function_call_deltas():
    worker = ScriptedWorker(says(TIME_CALL))
    payload = {"messages": USER, "functions": FUNCTIONS, "stream": True}
    response = post("/v1/chat/completions", payload, worker)
    assert response.status_code == 200, response.text
    events = [e for e in sse_events(response.text) if e != "[DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events]
    parts = [d["function_call"] for d in deltas if "function_call" in d]
    assert parts[0]["name"] == "get_time"
    assert all("name" not in p for p in parts[1:])
    assert json.loads("".join(p["arguments"] for p in parts)) == {"zone": "CET"}
    assert not any("tool_calls" in d for d in deltas)
    assert events[-1]["choices"][0]["finish_reason"] == "function_call"


def test_function_call_none_answers_in_text():
    completion, _ = chat(TIME_CALL, {"functions": FUNCTIONS, "function_call": "none"})
    assert completion.choices[0].finish_reason == "stop"
    assert completion.choices[0].message.content == TIME_CALL


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"functions": FUNCTIONS, "tools": [WEATHER]}, "functions"),
        ({"functions": FUNCTIONS, "tool_choice": "auto"}, "functions"),
        ({"functions": FUNCTIONS, "function_call": {"name": "get_date"}}, "function_call.name"),
        ({"functions": FUNCTIONS, "function_call": "required"}, "function_call"),
        ({"function_call": {"name": "get_time"}}, "function_call.name"),
    ],
)
def test_bad_legacy_bodies_are_refused(fields, param):
    response = post("/v1/chat/completions", {"messages": USER, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
