"""Tool calls with the official `openai` client against the shared real cluster (SmolLM2):
required, named and auto calls round-trip through the client's own types, streamed and not,
and a follow-up turn carries the calls and their results back."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.http_cluster import shared_http_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: str = Field(max_length=20)
    unit: str = Field(json_schema_extra={"enum": ["celsius", "fahrenheit"]})


WEATHER_TOOL = openai.pydantic_function_tool(GetWeather, name="get_weather")
WEATHER_SCHEMA = WEATHER_TOOL["function"]["parameters"]
CLOCK_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        "strict": True,
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
# what the 135M model, greedy, answers with the call it is shown (it calls no tool by itself)
COPY_A_CALL = [
    {
        "role": "user",
        "content": "Reply with this text and nothing else:\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
    }
]


@pytest.fixture(scope="module")
def oai(tmp_path_factory):
    return shared_http_cluster(tmp_path_factory).openai()


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def ask(oai, model, stream: bool, **kwargs):
    """One chat completion, whole (`parse`) or streamed and assembled by the client's stream
    helper, as the client's ParsedChatCompletion."""
    kwargs = {"model": model, "temperature": 0, "max_tokens": 200, **kwargs}
    if not stream:
        return oai.chat.completions.parse(**kwargs)
    with oai.chat.completions.stream(**kwargs) as events:
        for _ in events:
            pass
        return events.get_final_completion()


def weather_calls(completion) -> list:
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls, choice.message
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
        assert isinstance(call.function.parsed_arguments, GetWeather)  # the client parsed it
    return calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_and_named_calls_match_the_tool_schema(oai, model, stream):
    required = ask(
        oai, model, stream, messages=QUESTION, tools=[WEATHER_TOOL], tool_choice="required"
    )
    assert required.choices[0].message.content is None
    weather_calls(required)
    named = ask(
        oai,
        model,
        stream,
        messages=QUESTION,
        tools=[CLOCK_TOOL, WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    (call,) = weather_calls(named)
    one = ask(
        oai,
        model,
        stream,
        messages=QUESTION,
        tools=[WEATHER_TOOL, CLOCK_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    assert len(one.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_reads_the_models_call_and_a_follow_up_turn_answers(oai, model, stream):
    first = ask(oai, model, stream, messages=COPY_A_CALL, tools=[WEATHER_TOOL], tool_choice="auto")
    (call,) = weather_calls(first)
    assert call.function.parsed_arguments == GetWeather(city="Paris", unit="celsius")
    follow_up = [
        *COPY_A_CALL,
        first.choices[0].message,  # the client's own message type, sent back as it came
        {"role": "tool", "tool_call_id": call.id, "content": "21 degrees and sunny"},
    ]
    # create, not parse: what the model says next is free, and parse would validate it
    answer = oai.chat.completions.create(
        model=model, messages=follow_up, tools=[WEATHER_TOOL], max_tokens=16, temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls


def test_auto_and_none_answer_in_text_when_the_model_calls_nothing(oai, model):
    for choice in ("auto", "none"):
        r = oai.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say hello."}],
            tools=[WEATHER_TOOL],
            tool_choice=choice,
            temperature=0,
            max_tokens=12,
        )
        assert r.choices[0].message.content and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason in ("stop", "length")


def test_bad_tool_requests_are_400s_naming_the_field(oai, model):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(
            model=model,
            messages=QUESTION,
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "launch"}},
        )
    assert err.value.param == "tool_choice.function.name"
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=model, messages=QUESTION, tool_choice="required")
    assert err.value.param == "tool_choice"


class Report(BaseModel):
    """A weather report, as an answer in the body's format."""

    summary: str = Field(max_length=40)
    celsius: int


ASK_REPORT = [{"role": "user", "content": "Describe the weather in Paris as a short report."}]
COPY_A_REPORT = [
    {
        "role": "user",
        "content": 'Reply with this JSON and nothing else: {"summary": "Sunny", "celsius": 21}',
    }
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tools_beside_a_response_format_give_a_call_or_an_answer_in_the_format(oai, model, stream):
    """pydantic-ai's NativeOutput: tools (auto) and a json_schema response_format at once. The
    output is a call whose arguments match its tool, or content that matches the format. (Asked
    for a report, greedy SmolLM2 calls the tool, and where more calls may follow it repeats the
    call until its tokens run out, as it repeats sentences in free text: one call there.)"""
    single = {"parallel_tool_calls": False}
    made = set()
    for messages, more in ((COPY_A_CALL, {}), (ASK_REPORT, single), (COPY_A_REPORT, single)):
        completion = ask(
            oai,
            model,
            stream,
            messages=messages,
            tools=[WEATHER_TOOL],
            response_format=Report,
            **more,
        )
        choice = completion.choices[0]
        if choice.message.tool_calls:
            weather_calls(completion)
            assert choice.message.content is None
            made.add("call")
        else:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), Report.model_json_schema())
            assert isinstance(choice.message.parsed, Report)  # the client parsed it
            made.add("answer")
    assert made == {"call", "answer"}  # the copied call is a call, the copied report content
