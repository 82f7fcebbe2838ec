"""http/tools.py and http/tool_prompt.py: what a body's tools ask for, and the prompt they make."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from common import structured
from common.tokenizer import load_tokenizer
from frontend_svc.http.build import build_chat, chat_messages
from frontend_svc.http.errors import OpenAIError
from frontend_svc.http.protocol import ChatCompletionRequest
from frontend_svc.http.tool_prompt import template_inputs, template_renders_tools
from frontend_svc.http.tools import calls_schema, tool_plan
from frontend_svc.intake import Intake

TOK = load_tokenizer(None)
LL = structured.ll_tokenizer(TOK, TOK.eos_token_id)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
            "required": ["city"],
            "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"]}},
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"messages": USER, "tools": [WEATHER, CLOCK], **fields})


def accepts(schema: dict, text: str) -> bool:
    matcher = LLMatcher(LL, LLMatcher.grammar_from_json_schema(schema))
    ids = TOK.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_tools_default_to_auto_and_no_tools_to_no_plan():
    plan = tool_plan(body())
    assert plan.choice == "auto" and plan.names == ["get_weather", "get_time"] and plan.parallel
    assert plan.constraint() is None
    assert tool_plan(ChatCompletionRequest(messages=USER)) is None
    assert tool_plan(ChatCompletionRequest(messages=USER, tool_choice="none")) is None


def test_required_constrains_to_an_array_of_calls_each_matching_its_tool():
    schema = calls_schema(tool_plan(body(tool_choice="required")))
    call = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    assert accepts(schema, f"[{call}]")
    assert accepts(schema, f'[{call}, {{"name": "get_time", "arguments": {{}}}}]')
    assert not accepts(schema, "[]")
    assert not accepts(schema, '[{"name": "get_weather", "arguments": {"unit": "celsius"}}]')
    assert not accepts(schema, '[{"name": "get_weather", "arguments": {"city": "P", "unit": "K"}}]')
    assert not accepts(schema, '[{"name": "launch", "arguments": {}}]')
    single = calls_schema(tool_plan(body(tool_choice="required", parallel_tool_calls=False)))
    assert accepts(single, f"[{call}]") and not accepts(single, f"[{call}, {call}]")


def test_a_named_choice_constrains_to_that_tools_parameters():
    named = {"type": "function", "function": {"name": "get_weather"}}
    plan = tool_plan(body(tool_choice=named))
    assert plan.choice == "function" and plan.function_name == "get_weather"
    schema = json.loads(plan.constraint().spec)
    assert accepts(schema, '{"city": "Paris"}') and not accepts(schema, '{"unit": "celsius"}')
    no_parameters = tool_plan(
        body(tool_choice={"type": "function", "function": {"name": "get_time"}})
    )
    assert accepts(json.loads(no_parameters.constraint().spec), "{}")


BAD_TOOLS = [
    # (fields, param, words of the message)
    ({"tool_choice": "sometimes"}, "tool_choice", "not one of"),
    ({"tool_choice": {"type": "function"}}, "tool_choice", "must be"),
    (
        {"tool_choice": {"type": "function", "function": {"name": "launch"}}},
        "tool_choice",
        "not in tools",
    ),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    (
        {"tools": [{"type": "function", "function": {"name": "a b"}}]},
        "tools.0.function.name",
        "letters",
    ),
    ({"tools": [CLOCK, CLOCK]}, "tools.1.function", "twice"),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
            ]
        },
        "tools.0.function.parameters",
        "type object",
    ),
]


@pytest.mark.parametrize("fields,param,needle", BAD_TOOLS)
def test_malformed_tool_requests_are_400s_naming_the_field(fields, param, needle):
    intake = Intake(TOK, "fake", {"fake"}, 512)
    with pytest.raises(OpenAIError) as err:
        build_chat(intake, body(**fields))
    assert err.value.status == 400 and err.value.param.startswith(param), err.value.param
    assert needle in err.value.message


def test_none_keeps_the_tools_in_the_prompt_and_allows_another_constraint():
    intake = Intake(TOK, "fake", {"fake"}, 512)
    state = build_chat(intake, body(tool_choice="none", response_format={"type": "json_object"}))
    assert state.params.structured.kind == "json_object"
    assert "get_weather" in TOK.decode(state.prompt_token_ids)


def test_auto_keeps_the_tools_in_the_prompt_and_a_call_or_the_body_format_on_the_output():
    intake = Intake(TOK, "fake", {"fake"}, 512)
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    state = build_chat(intake, body(response_format=fmt))
    assert state.params.structured.kind == "any_of"  # tests/unit/frontend/test_tools_beside_format
    assert "get_weather" in TOK.decode(state.prompt_token_ids)


def test_required_and_named_choices_beside_another_constraint_keep_the_tools_constraint():
    intake = Intake(TOK, "fake", {"fake"}, 512)
    required = build_chat(
        intake, body(tool_choice="required", response_format={"type": "json_object"})
    )
    assert required.params.structured.spec == json.dumps(
        calls_schema(tool_plan(body(tool_choice="required")))
    )
    named = {"type": "function", "function": {"name": "get_weather"}}
    state = build_chat(intake, body(tool_choice=named, guided_regex="a+"))
    assert json.loads(state.params.structured.spec) == WEATHER["function"]["parameters"]


def conversation() -> list[dict]:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    clock = {
        "id": "call_2",
        "type": "function",
        "function": {"name": "get_time", "arguments": "{}"},
    }
    request = ChatCompletionRequest(
        messages=[
            {"role": "system", "content": "Be brief."},
            *USER,
            {"role": "assistant", "content": None, "tool_calls": [call, clock]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
            {"role": "tool", "tool_call_id": "call_2", "name": "get_time", "content": "noon"},
        ],
        tools=[WEATHER, CLOCK],
    )
    return chat_messages(request), tool_plan(request)


def test_a_template_without_tools_gets_them_in_the_system_message_hermes_style():
    assert not template_renders_tools(TOK.chat_template)
    messages, plan = conversation()
    rendered, context = template_inputs(messages, plan, TOK.chat_template)
    assert context == {}
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert all(set(m) == {"role", "content"} for m in rendered)
    system = rendered[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools")
    assert json.dumps(plan.shown()[0]) in system and "<tool_call>" in system
    assert rendered[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    results = rendered[3]["content"].split("\n</tool_response>\n")
    assert json.loads(results[0].removeprefix("<tool_response>\n")) == {
        "name": "get_weather",
        "tool_call_id": "call_1",
        "content": "21 C",
    }
    assert '"name": "get_time"' in results[1]
    text = TOK.apply_chat_template(rendered, tokenize=False)
    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")


QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }}"
    "{% endfor %}{% if m.tool_call_id %}RESULT {{ m.tool_call_id }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_renders_tools_gets_them_as_transformers_passes_them():
    assert template_renders_tools(QWEN_LIKE)
    messages, plan = conversation()
    rendered, context = template_inputs(messages, plan, QWEN_LIKE)
    assert context == {"tools": plan.shown()}
    assert rendered[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert rendered[3] == {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}
    tok = load_tokenizer(None)
    tok.chat_template = QWEN_LIKE
    text = tok.apply_chat_template(rendered, tokenize=False, **context)
    assert '"name": "get_weather"' in text.split("<|im_end|>")[0]
    assert "CALL get_weather Paris" in text and "RESULT call_1" in text
