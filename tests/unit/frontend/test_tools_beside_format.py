"""Tools beside an output format (pydantic-ai's NativeOutput, the OpenAI Agents SDK): with
`auto` one grammar allows a call or an answer in the format, and the response is the call
(finish `tool_calls`) or the formatted content, streamed or not. Over the HTTP app in-process,
with test_tools_http.py's scripted worker; every scripted output is checked against the
constraint the worker was sent, so the grammar and the parser agree on the call syntax."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from common import structured
from common.messages import StructuredOutput
from frontend_svc.http.protocol import ChatCompletionRequest
from frontend_svc.http.tool_prompt import calls_are_tagged
from frontend_svc.http.tools import call_or_answer, tool_plan
from tests.unit.frontend.test_tools_http import CLOCK, TOK, USER, WEATHER, both_ways, calls_of, post

LL = structured.ll_tokenizer(TOK, TOK.eos_token_id)
ANSWER = {
    "type": "object",
    "properties": {"summary": {"type": "string"}, "celsius": {"type": "integer"}},
    "required": ["summary", "celsius"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "report", "schema": ANSWER}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REPORT = '{"summary": "Sunny", "celsius": 21}'


def allows(constraint: StructuredOutput, text: str) -> bool:
    matcher = LLMatcher(LL, structured.check(constraint, LL), log_level=0)
    ids = TOK.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def sent_constraint(worker) -> StructuredOutput:
    (constraint,) = set(worker.constraints)
    return constraint


def test_a_call_beside_a_format_is_a_tool_call_streamed_and_not():
    payload = {"tools": [WEATHER, CLOCK], "response_format": FORMAT}
    whole, streamed, worker = both_ways(CALL, payload)
    for completion in (whole, streamed):
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert calls_of(completion) == [("get_weather", {"city": "Paris"})]
    constraint = sent_constraint(worker)
    assert constraint.kind == "any_of" and allows(constraint, CALL)


def test_an_answer_in_the_format_is_the_content_streamed_and_not():
    payload = {"tools": [WEATHER, CLOCK], "response_format": FORMAT}
    whole, streamed, worker = both_ways(REPORT, payload)
    for completion in (whole, streamed):
        choice = completion.choices[0]
        assert choice.finish_reason == "stop" and not choice.message.tool_calls
        assert json.loads(choice.message.content) == {"summary": "Sunny", "celsius": 21}
    constraint = sent_constraint(worker)
    assert allows(constraint, REPORT) and allows(constraint, CALL)
    for text in ("It is sunny.", '{"summary": "Sunny"}', f"{REPORT}\n{CALL}", "Hm.\n" + CALL):
        assert not allows(constraint, text), text


def test_any_json_object_beside_tools_is_content_and_a_tagged_call_is_a_call():
    payload = {"tools": [WEATHER], "response_format": {"type": "json_object"}}
    whole, streamed, worker = both_ways('{"city": "Paris"}', payload)
    for completion in (whole, streamed):
        assert completion.choices[0].finish_reason == "stop"
        assert completion.choices[0].message.content == '{"city": "Paris"}'
    assert allows(sent_constraint(worker), CALL)


def test_parallel_calls_are_one_block_a_line_and_one_without_parallel_calls():
    two = CALL + "\n" + CALL.replace("Paris", "Rome")
    whole, streamed, worker = both_ways(two, {"tools": [WEATHER], "response_format": FORMAT})
    for completion in (whole, streamed):
        assert calls_of(completion) == [
            ("get_weather", {"city": "Paris"}),
            ("get_weather", {"city": "Rome"}),
        ]
    assert allows(sent_constraint(worker), two)
    payload = {"tools": [WEATHER], "response_format": FORMAT, "parallel_tool_calls": False}
    response, worker = post(CALL, {"messages": USER, **payload})
    assert response.json()["choices"][0]["finish_reason"] == "tool_calls"
    single = sent_constraint(worker)
    assert allows(single, CALL) and not allows(single, two)


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_required_and_named_choices_beside_a_format_constrain_to_the_call(choice):
    text = (
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
        if choice == "required"
        else '{"city": "Paris"}'
    )
    payload = {"tools": [WEATHER], "tool_choice": choice, "response_format": FORMAT}
    whole, streamed, worker = both_ways(text, payload)
    for completion in (whole, streamed):
        assert completion.choices[0].finish_reason == "tool_calls"
        assert calls_of(completion) == [("get_weather", {"city": "Paris"})]
    constraint = sent_constraint(worker)
    assert constraint.kind == "json_schema"
    assert allows(constraint, text) and not allows(constraint, REPORT)


def test_none_beside_a_format_constrains_to_the_format_alone():
    payload = {"tools": [WEATHER], "tool_choice": "none", "response_format": FORMAT}
    response, worker = post(REPORT, {"messages": USER, **payload})
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == REPORT
    constraint = sent_constraint(worker)
    assert constraint == StructuredOutput("json_schema", json.dumps(ANSWER))
    assert not allows(constraint, CALL)


def test_a_template_that_renders_tools_without_tags_gets_a_bare_call_object():
    qwen = "{% for tool in tools %}{{ tool }}{% endfor %}<tool_call>{{ name }}</tool_call>"
    llama = "{% if tools %}{{ tools | tojson }}{% endif %}"
    assert calls_are_tagged(None) and calls_are_tagged("{{ messages }}") and calls_are_tagged(qwen)
    assert not calls_are_tagged(llama)
    plan = tool_plan(ChatCompletionRequest(messages=USER, tools=[WEATHER]))
    bare = call_or_answer(plan, StructuredOutput("json_schema", json.dumps(ANSWER)), False)
    assert allows(bare, '{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert allows(bare, REPORT)
    assert not allows(bare, CALL)
