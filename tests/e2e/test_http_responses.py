"""/v1/responses with the official `openai` client (and the OpenAI Agents SDK, when installed)
against the shared real cluster (SmolLM2): text streamed and not, a function tool loop, and
text.format with a JSON schema (responses.parse)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pydantic
import pytest

from tests.e2e.http_cluster import API_KEY, shared_http_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    return shared_http_cluster(tmp_path_factory)


@pytest.fixture(scope="module")
def oai(cluster):
    return cluster.openai()


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def test_text_streamed_equals_whole_and_continues_by_id(oai, model):
    ask = {"model": model, "temperature": 0, "max_output_tokens": 16}
    whole = oai.responses.create(input="What is the capital of France?", **ask)
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.usage.output_tokens <= 16 and whole.usage.input_tokens > 5
    with oai.responses.stream(input="What is the capital of France?", **ask) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text  # greedy: the same text
    assert final.usage.output_tokens == whole.usage.output_tokens
    follow = oai.responses.create(input="And of Spain?", previous_response_id=whole.id, **ask)
    assert follow.previous_response_id == whole.id and follow.output_text
    assert follow.usage.input_tokens > whole.usage.input_tokens  # the first turn came along


class Capital(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    country: str = pydantic.Field(max_length=20)
    city: str = pydantic.Field(max_length=20)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_text_format_holds_the_answer_to_its_schema(oai, model, stream):
    ask = {
        "model": model,
        "temperature": 0,
        "max_output_tokens": 64,
        "input": "What is the capital of France? Answer in JSON.",
        "text_format": Capital,
    }
    if stream:
        with oai.responses.stream(**ask) as events:
            response = events.get_final_response()
    else:
        response = oai.responses.parse(**ask)
    assert response.status == "completed"
    parsed = response.output_parsed
    assert isinstance(parsed, Capital)  # the client parsed it against the model: the schema held
    assert json.loads(response.output_text) == parsed.model_dump()
    # constrained JSON has one layout, json.dumps' own (docs/structured_output.md)
    assert response.output_text == json.dumps(json.loads(response.output_text))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_required_call_then_its_result_answered(oai, model, stream):
    ask = {"model": model, "temperature": 0, "max_output_tokens": 64, "tools": [WEATHER]}
    if stream:
        with oai.responses.stream(input=QUESTION, tool_choice="required", **ask) as events:
            kinds = {e.type for e in events}
            first = events.get_final_response()
        assert "response.function_call_arguments.delta" in kinds
    else:
        first = oai.responses.create(input=QUESTION, tool_choice="required", **ask)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    results = [
        {"type": "function_call_output", "call_id": c.call_id, "output": "21 C and sunny"}
        for c in calls
    ]
    answer = oai.responses.create(
        input=[{"role": "user", "content": QUESTION}, *first.output, *results],
        tool_choice="none",
        **ask,
    )
    assert answer.output_text and answer.status in ("completed", "incomplete")
    assert all(item.type == "message" for item in answer.output)


def test_a_built_in_tool_is_refused(oai, model):
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=model, input=QUESTION, tools=[{"type": "web_search"}])
    assert err.value.param == "tools.0.type"


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_an_agents_sdk_agent_runs_its_tool_loop(cluster, model, streamed):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"21 C and sunny in {city}"

    client = openai.AsyncOpenAI(
        base_url=cluster.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120
    )
    agent = agents.Agent(
        name="weather",
        instructions="Answer questions about the weather with the get_weather tool.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=model, openai_client=client),
        # the first turn must call; after it the SDK sets tool_choice back to auto
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=256),
    )

    async def run():
        if not streamed:
            return await agents.Runner.run(agent, QUESTION, max_turns=6)
        result = agents.Runner.run_streamed(agent, QUESTION, max_turns=6)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    assert cities and all(0 < len(city) <= 20 for city in cities)  # the schema held
    assert isinstance(result.final_output, str)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item"
