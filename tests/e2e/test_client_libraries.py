"""instructor, LangChain, pydantic-ai and the OpenAI Agents SDK against the shared real cluster
(SmolLM2), each doing what its users do first: extract a Pydantic model, call a tool, run an
agent's tool loop to its answer.

The libraries are not the project's dependencies: a test whose library is not installed is
skipped, saying so. A model this small follows instructions poorly, so each test asks for a
constrained turn (a named or required tool, a JSON schema), where the server guarantees the
shape; what is checked is that the library reads it back. The bodies these libraries send are
replayed without a model in tests/unit/frontend/test_client_bodies.py."""

from __future__ import annotations

import asyncio
from typing import Annotated

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.e2e.http_cluster import API_KEY, shared_http_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ABOUT = "Paris is the capital of France."
QUESTION = "What is the weather in Paris?"


class City(BaseModel):
    """A city and the country it is in."""

    # bounded (no other keys, short strings), so that the answer ends within max_tokens
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    return shared_http_cluster(tmp_path_factory)


@pytest.fixture(scope="module")
def model(cluster):
    return cluster.openai().models.list().data[0].id


def weather_tool(cities: list[str]):
    def get_weather(city: Annotated[str, Field(max_length=20)]) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"21 C and sunny in {city}"

    return get_weather


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_extracts_a_pydantic_model(cluster, model, mode):
    instructor = pytest.importorskip("instructor", reason="instructor is not installed")
    client = instructor.from_openai(cluster.openai(), mode=instructor.Mode[mode])
    city = client.chat.completions.create(
        model=model,
        response_model=City,
        messages=[{"role": "user", "content": f"{ABOUT} Extract the city."}],
        max_retries=0,  # the server's constraint, not a retry, makes the answer fit
        temperature=0,
        max_tokens=64,
    )
    assert isinstance(city, City) and city.name and city.country


def test_langchain_structured_output_and_a_tool_call(cluster, model):
    chat_models = pytest.importorskip(
        "langchain_openai", reason="langchain-openai is not installed"
    )
    chat = chat_models.ChatOpenAI(
        model=model,
        base_url=cluster.base_url + "/v1",
        api_key=API_KEY,
        temperature=0,
        max_tokens=64,
        max_retries=0,
    )
    for method in ("function_calling", "json_schema"):
        city = chat.with_structured_output(City, method=method).invoke(f"{ABOUT} Which city?")
        assert isinstance(city, City) and city.name and city.country, method
    cities: list[str] = []
    # strict: no other keys than the tool's, so that the call ends within max_tokens
    bound = chat.bind_tools([weather_tool(cities)], tool_choice="get_weather", strict=True)
    reply = bound.invoke(QUESTION)
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    assert isinstance(call["args"]["city"], str) and call["args"]["city"]


def test_a_pydantic_ai_agent_runs_its_tool_to_a_result(cluster, model):
    pytest.importorskip("pydantic_ai", reason="pydantic-ai-slim[openai] is not installed")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=cluster.base_url + "/v1", api_key=API_KEY)
    cities: list[str] = []

    def settings(ctx) -> dict:
        # the first turn must call the tool; the next answers in text
        return {"temperature": 0, "max_tokens": 48, "tool_choice": "none" if cities else "required"}

    agent = Agent(
        OpenAIChatModel(model, provider=provider),
        tools=[weather_tool(cities)],
        instructions="Answer questions about the weather with the get_weather tool.",
        model_settings=settings,
    )
    result = agent.run_sync(QUESTION)
    assert len(cities) == 1 and cities[0]
    assert isinstance(result.output, str) and result.output
    kinds = [part.part_kind for message in result.all_messages() for part in message.parts]
    assert kinds[-3:] == ["tool-call", "tool-return", "text"], kinds


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_an_agents_sdk_runner_calls_its_function_tool(cluster, model, api):
    agents = pytest.importorskip("agents", reason="openai-agents is not installed")
    agents.set_tracing_disabled(True)
    cities: list[str] = []
    client = openai.AsyncOpenAI(
        base_url=cluster.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120
    )
    if api == "responses":
        llm = agents.OpenAIResponsesModel(model=model, openai_client=client)
    else:
        llm = agents.OpenAIChatCompletionsModel(model=model, openai_client=client)
    agent = agents.Agent(
        name="weather",
        instructions="Answer questions about the weather with the get_weather tool.",
        tools=[agents.function_tool(weather_tool(cities))],
        model=llm,
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=48),
        # the tool's result is the answer: a free second turn of a model this small may ramble
        # past max_tokens (test_http_responses.py runs the whole loop, answer included)
        tool_use_behavior="stop_on_first_tool",
    )
    result = asyncio.run(agents.Runner.run(agent, QUESTION, max_turns=2))
    assert len(cities) == 1 and cities[0]
    assert result.final_output == f"21 C and sunny in {cities[0]}"
    assert [item.type for item in result.new_items] == ["tool_call_item", "tool_call_output_item"]
