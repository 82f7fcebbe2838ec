"""/v1/responses over the HTTP app in-process, driven by the official `openai` client: a real
tokenizer and a worker that answers each turn with the text the test scripts for it. Every
response object and stream event is also checked against the client's own types."""

from __future__ import annotations

import asyncio
import json

import httpx2
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from frontend_svc.http import create_app
from frontend_svc.http.responses_store import ResponseStore
from frontend_svc.intake import Intake
from tests.engine_fakes import TOKENIZER_VOCAB, http_context, make_engine, registration, run_session
from tests.unit.frontend.http_harness import TOK, ScriptedWorker, says

MODEL = "fake"
EVENTS = TypeAdapter(ResponseStreamEvent)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class TurnWorker(ScriptedWorker):
    """Answers each request with the text `say` set last, and keeps its sampling params."""

    def __init__(self) -> None:
        super().__init__(says(""))
        self.params = []

    def say(self, text: str) -> None:
        self.reply = says(text)

    async def execute(self, out):
        self.params += [new.sampling_params for new in out.new_requests]
        return await super().execute(out)


def serve(test, api_key: str = ""):
    """Runs `test(client, http, worker)`: the official client and a plain one on the app."""

    async def main():
        worker = TurnWorker()
        engine = make_engine(TOKENIZER_VOCAB)
        ctx = http_context(engine, Intake(TOK, MODEL, {MODEL}, 512), api_key)
        session = engine.attach(registration("w0", num_blocks=256), worker)
        task = asyncio.create_task(run_session(engine, session))
        transport = httpx2.ASGITransport(app=create_app(ctx))
        http = httpx2.AsyncClient(transport=transport, base_url="http://test")
        client = openai.AsyncOpenAI(
            base_url="http://test/v1", api_key=api_key or "none", max_retries=0, http_client=http
        )
        try:
            return await test(client, http, worker)
        finally:
            await http.aclose()
            session.mark_lost("test over")
            await task

    return asyncio.run(main())


async def create(client, **kwargs) -> Response:
    """A whole response, validated as the client's Response type (not merely constructed)."""
    raw = await client.responses.with_raw_response.create(model=MODEL, temperature=0, **kwargs)
    return Response.model_validate(json.loads(raw.http_response.text))


async def raw_events(http, payload: dict) -> list:
    """A stream's events, each validated as the client's event union; the `event:` line names
    the type its data carries."""
    r = await http.post("/v1/responses", json={"model": MODEL, "stream": True, **payload})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in filter(None, r.text.split("\n\n")):
        name, data = block.split("\n")
        event = EVENTS.validate_python(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {event.type}"
        events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_text_whole_and_streamed_parse_as_the_clients_types():
    async def test(client, http, worker):
        worker.say("Hello there, friend.")
        whole = await create(
            client,
            input="Hi!",
            instructions="Be kind.",
            reasoning={"effort": "low"},
            metadata={"team": "a"},
            user="u1",
            service_tier="auto",
            safety_identifier="s1",
            prompt_cache_key="k1",
            truncation="disabled",
            include=["reasoning.encrypted_content"],
        )
        async with client.responses.stream(model=MODEL, input="Hi!") as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_response()
        events = await raw_events(http, {"input": "Hi!"})
        return whole, kinds, final, events, worker.prompts

    whole, kinds, final, events, prompts = serve(test)
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.status == "completed" and whole.incomplete_details is None
    (message,) = whole.output
    assert message.type == "message" and message.id.startswith("msg_")
    assert message.role == "assistant" and message.status == "completed"
    assert whole.output_text == "Hello there, friend."
    assert whole.instructions == "Be kind." and whole.model == MODEL
    assert whole.reasoning.effort == "low" and whole.metadata == {"team": "a"}
    assert (whole.user, whole.safety_identifier, whole.prompt_cache_key) == ("u1", "s1", "k1")
    assert whole.store is True and whole.text.format.type == "text"
    usage = whole.usage
    text_tokens = len(TOK.encode("Hello there, friend.", add_special_tokens=False))
    assert usage.output_tokens == text_tokens + 1  # and the EOS that ended it
    assert usage.input_tokens > 3
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert "Be kind." in prompts[0] and "Hi!" in prompts[0]
    assert "Be kind." not in prompts[1]
    assert final.output_text == "Hello there, friend." and final.status == "completed"
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(d.delta for d in deltas) == "Hello there, friend."
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-1].response.usage.output_tokens == usage.output_tokens
    item_ids = {e.item_id for e in deltas} | {events[-2].item.id}
    assert len(item_ids) == 1  # every event of the message names the same item


def test_a_function_tool_loop_round_trips_through_the_client():
    async def test(client, http, worker):
        worker.say(f"Let me look.\n{CALL}")
        first = await create(client, input="Weather in Paris?", tools=[WEATHER])
        worker.say("It is 21 C and sunny in Paris.")
        results = [
            {"type": "function_call_output", "call_id": c.call_id, "output": "21 C, sunny"}
            for c in first.output
            if c.type == "function_call"
        ]
        follow_up = [{"role": "user", "content": "Weather in Paris?"}, *first.output, *results]
        second = await create(client, input=follow_up, tools=[WEATHER])
        worker.say(CALL)
        events = await raw_events(http, {"input": "Weather?", "tools": [WEATHER]})
        async with client.responses.stream(model=MODEL, input="Weather?", tools=[WEATHER]) as s:
            streamed = await s.get_final_response()
        worker.say("Sunny.")
        (call,) = streamed.output
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "sun"}
        # the stream helper's parsed items (parsed_arguments and all) go back as they came
        third = await create(
            client,
            input=[{"role": "user", "content": "Weather?"}, *streamed.output, result],
            tools=[WEATHER],
        )
        return first, second, events, call, third, worker.prompts

    first, second, events, streamed_call, third, prompts = serve(test)
    assert streamed_call.parsed_arguments == {"city": "Paris"}  # the client read our call
    assert third.output_text == "Sunny." and "sun" in prompts[-1]
    assert first.status == "completed"
    message, call = first.output
    assert message.type == "message" and message.content[0].text == "Let me look."
    assert call.type == "function_call" and call.id.startswith("fc_")
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert first.tools[0].name == "get_weather" and first.tool_choice == "auto"
    assert second.output_text == "It is 21 C and sunny in Paris."
    assert '"name": "get_weather"' in prompts[0]  # the tool was shown
    assert CALL in prompts[1] and "21 C, sunny" in prompts[1]  # the call and its result
    assert prompts[1].index(CALL) < prompts[1].index("21 C, sunny")
    kinds = [e.type for e in events]
    assert "response.content_part.added" not in kinds  # a call only: no message
    assert kinds.count("response.function_call_arguments.delta") > 1
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.arguments == ""
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert json.loads(done.arguments) == {"city": "Paris"} == json.loads("".join(fragments))
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].call_id == added.item.call_id


def test_named_tool_choice_constrains_to_that_tools_parameters():
    async def test(client, http, worker):
        worker.say('{"city": "Paris"}')
        choice = {"type": "function", "name": "get_weather"}
        response = await create(client, input="Weather?", tools=[WEATHER], tool_choice=choice)
        return response, worker.params[0].structured

    response, structured = serve(test)
    (call,) = response.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    assert response.tool_choice.name == "get_weather"
    assert structured.kind == "json_schema"
    assert json.loads(structured.spec) == WEATHER["parameters"]


class City(BaseModel):
    city: str
    degrees: int


def test_text_format_json_schema_constrains_and_the_client_parses_it():
    async def test(client, http, worker):
        worker.say('{"city": "Paris", "degrees": 21}')
        parsed = await client.responses.parse(model=MODEL, input="Paris?", text_format=City)
        return parsed, worker.params[0].structured

    parsed, structured = serve(test)
    assert parsed.output_parsed == City(city="Paris", degrees=21)
    assert parsed.text.format.type == "json_schema" and parsed.text.format.name == "City"
    assert structured.kind == "json_schema"
    assert json.loads(structured.spec)["properties"]["degrees"]["type"] == "integer"


def test_max_output_tokens_makes_an_incomplete_response():
    async def test(client, http, worker):
        worker.say("one two three four five six seven eight nine ten")
        whole = await create(client, input="Count", max_output_tokens=3)
        events = await raw_events(http, {"input": "Count", "max_output_tokens": 3})
        return whole, events

    whole, events = serve(test)
    assert whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output[0].status == "incomplete" and whole.usage.output_tokens == 3
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_previous_response_id_continues_and_store_false_keeps_nothing():
    async def test(client, http, worker):
        worker.say("Nice to meet you, Ada.")
        first = await create(client, input="My name is Ada.", instructions="Be brief.")
        worker.say("Your name is Ada.")
        second = await create(client, input="What is my name?", previous_response_id=first.id)
        got = await client.responses.retrieve(first.id)
        unstored = await create(client, input="Hi", store=False)
        with pytest.raises(openai.NotFoundError) as gone:
            await create(client, input="Again", previous_response_id=unstored.id)
        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        return first, second, got, gone.value, worker.prompts

    first, second, got, gone, prompts = serve(test)
    assert second.previous_response_id == first.id
    assert second.output_text == "Your name is Ada."
    history = prompts[1]
    order = [history.index(s) for s in ("My name is Ada.", "Nice to meet you, Ada.", "my name?")]
    assert order == sorted(order)
    assert "Be brief." in prompts[0] and "Be brief." not in history  # instructions stay behind
    assert got.id == first.id and got.output_text == "Nice to meet you, Ada."
    assert gone.status_code == 404 and gone.param == "previous_response_id"
    assert "not found" in gone.message


@pytest.mark.parametrize(
    "payload,param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["x"]}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "name": "f", "paramaters": {}}]}, "tools.0.paramaters"),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "What is this?"},
                            {"type": "input_image", "image_url": "https://x/y.png"},
                        ],
                    }
                ]
            },
            "input.0.content.1.type",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
            "input.0.call_id",
        ),
        ({"input": []}, "input"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "x"}},
            "tool_choice",
        ),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"truncation": "auto"}, "truncation"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include.0"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": "1"}, "temperature"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(payload, param):
    async def test(client, http, worker):
        r = await http.post("/v1/responses", json={"model": MODEL, "input": "Hi", **payload})
        return r, worker.prompts

    r, prompts = serve(test)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] and error["param"].startswith(param), error
    assert prompts == []  # nothing ran


@pytest.mark.parametrize(
    "payload,param",
    [
        (
            {"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]},
            "tools.0.parameters",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}},
            "tool_choice.name",
        ),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}}, None),
    ],
)
def test_a_chat_pipeline_refusal_names_this_bodys_field(payload, param):
    async def test(client, http, worker):
        with pytest.raises(openai.BadRequestError) as err:
            await create(client, input="Hi", **payload)
        return err.value

    err = serve(test)
    assert err.param == (param or "text.format.schema"), err.body
    assert "response_format" not in err.message and "function.parameters" not in err.message


def test_allowed_tools_shows_and_allows_only_the_named_tools():
    clock = {"type": "function", "name": "get_time", "parameters": None, "strict": False}

    async def test(client, http, worker):
        worker.say('[{"name": "get_weather", "arguments": {"city": "Paris"}}]')
        allowed = {"type": "allowed_tools", "mode": "required", "tools": [WEATHER]}
        response = await create(
            client, input="Weather?", tools=[clock, WEATHER], tool_choice=allowed
        )
        return response, worker.prompts[0], worker.params[0].structured

    response, prompt, structured = serve(test)
    (call,) = response.output
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert '"get_weather"' in prompt and '"get_time"' not in prompt
    assert structured is not None and "get_time" not in structured.spec
    assert response.tool_choice.type == "allowed_tools" and len(response.tools) == 2


def test_unknown_previous_response_and_retrieve_are_404s():
    async def test(client, http, worker):
        first = await http.post(
            "/v1/responses", json={"input": "Hi", "previous_response_id": "resp_nope"}
        )
        second = await http.get("/v1/responses/resp_nope")
        return first, second

    first, second = serve(test)
    for r in (first, second):
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "not_found_error"
        assert "resp_nope" in r.json()["error"]["message"]
    assert first.json()["error"]["param"] == "previous_response_id"


def test_the_api_key_guards_responses_as_every_v1_route():
    async def test(client, http, worker):
        worker.say("ok")
        bare = await http.post("/v1/responses", json={"input": "Hi"})
        listed = await http.get("/v1/responses/resp_x")
        keyed = await create(client, input="Hi")
        return bare, listed, keyed

    bare, listed, keyed = serve(test, api_key="sesame")
    assert bare.status_code == 401 and listed.status_code == 401
    assert keyed.output_text == "ok"


# ---- the store ------------------------------------------------------------------------------
def response(i: int, text: str = "x") -> dict:
    return {"id": f"resp_{i}", "output": [text]}


def test_store_bounds_entries_and_bytes_oldest_first():
    store = ResponseStore(max_entries=3, max_bytes=10_000)
    for i in range(5):
        assert store.put(response(i), [])
    assert len(store) == 3 and store.get("resp_1") is None and store.get("resp_4") is not None
    big = ResponseStore(max_entries=100, max_bytes=600)
    for i in range(4):
        big.put(response(i, "y" * 200), [])
    assert big.get("resp_0") is None and big.get("resp_3") is not None
    assert not big.put(response(9, "z" * 700), [])  # too big alone: not kept
    assert big.get("resp_9") is None and big.get("resp_3") is not None


def test_store_forgets_a_response_after_its_time():
    now = [0.0]
    store = ResponseStore(ttl_s=60, clock=lambda: now[0])
    store.put(response(1), [{"type": "message"}])
    now[0] = 59.0
    assert store.get("resp_1").conversation == [{"type": "message"}]
    now[0] = 60.0
    assert store.get("resp_1") is None and len(store) == 0
    assert not store.delete("resp_1")
