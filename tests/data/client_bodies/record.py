"""Record the request bodies that instructor, LangChain, pydantic-ai and the OpenAI Agents SDK
send, for tests/unit/frontend/test_client_bodies.py to replay against the app.

The libraries are not the project's dependencies; record from a virtualenv of their own:

    python3 -m venv /tmp/libvenv
    /tmp/libvenv/bin/pip install instructor langchain-openai 'pydantic-ai-slim[openai]' \
        openai-agents
    /tmp/libvenv/bin/python tests/data/client_bodies/record.py

It starts a stub OpenAI server on a free local port that keeps every request's method, path and
JSON body and answers with canned but well-formed responses (text, a tool call whose arguments
fit the tool's schema, SSE chunks, a Responses API object) so each library's calls run to their
end. Every body is written to <library>/<name>.json beside this file, overwriting the old one;
a call that sends two requests (a tool loop) keeps both, as <name>.json and <name>.2.json,
unless its second turn is a shape already kept. The model is called "fake", the name the
in-process app serves, so the bodies replay unchanged.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import version
from pathlib import Path

from pydantic import BaseModel

HERE = Path(__file__).resolve().parent
MODEL = "fake"
API_KEY = "record-key"
TEXT = "It is 21 C and sunny in Paris."

_ids = itertools.count(1)


# ---- answers that fit the request -----------------------------------------------------------


def example(schema: dict, defs: dict | None = None) -> object:
    """A value that satisfies a (simple, pydantic-made) JSON schema."""
    defs = defs if defs is not None else schema.get("$defs", schema.get("definitions", {}))
    if "$ref" in schema:
        return example(defs[schema["$ref"].rsplit("/", 1)[-1]], defs)
    if "enum" in schema:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return example(schema[key][0], defs)
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = next(k for k in kind if k != "null")
    if kind == "object":
        props = schema.get("properties", {})
        return {name: example(sub, defs) for name, sub in props.items()}
    if kind == "array":
        return [example(schema.get("items", {"type": "string"}), defs)]
    return {"string": "Paris", "integer": 2, "number": 21.5, "boolean": True, "null": None}[kind]


def _chat_tool_call(body: dict) -> tuple[str, dict] | None:
    """The (name, schema) of the function this chat turn should call, or None for text."""
    tools = [t["function"] for t in body.get("tools") or [] if t.get("type") == "function"]
    choice = body.get("tool_choice", "auto")
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        allowed = {t.get("function", t)["name"] for t in choice["allowed_tools"]["tools"]}
        tools = [t for t in tools if t["name"] in allowed]
        choice = choice["allowed_tools"]["mode"]
    if not tools or choice == "none":
        return None
    if isinstance(choice, dict) and "function" in choice:
        forced = next(t for t in tools if t["name"] == choice["function"]["name"])
        return forced["name"], forced.get("parameters", {})
    last = body["messages"][-1]
    outputs = [t for t in tools if t["name"].startswith("final_result")]
    if last.get("role") == "tool":  # the tool answered: finish, through an output tool if any
        return (outputs[0]["name"], outputs[0].get("parameters", {})) if outputs else None
    first = ([t for t in tools if t not in outputs] or outputs)[0]
    return first["name"], first.get("parameters", {})


def _chat_text(body: dict) -> str:
    fmt = body.get("response_format") or {}
    if fmt.get("type") == "json_schema":
        return json.dumps(example(fmt["json_schema"]["schema"]))
    if fmt.get("type") == "json_object":
        return json.dumps(example(City.model_json_schema()))
    return TEXT


def chat_reply(body: dict) -> dict:
    call = _chat_tool_call(body)
    message: dict = {"role": "assistant", "content": None if call else _chat_text(body)}
    if call:
        message["tool_calls"] = [
            {
                "id": f"call_{next(_ids)}",
                "type": "function",
                "function": {"name": call[0], "arguments": json.dumps(example(call[1]))},
            }
        ]
    return {
        "id": f"chatcmpl-{next(_ids)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model", MODEL),
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if call else "stop",
                "logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20},
    }


def chat_chunks(body: dict) -> list[dict]:
    whole = chat_reply(body)
    msg, base = whole["choices"][0]["message"], {k: whole[k] for k in ("id", "created", "model")}
    base["object"] = "chat.completion.chunk"

    def chunk(delta: dict, finish=None) -> dict:
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    out = [chunk({"role": "assistant", "content": ""})]
    if msg.get("tool_calls"):
        call = msg["tool_calls"][0]
        out.append(chunk({"tool_calls": [{"index": 0, **call}]}))
    else:
        text = msg["content"]
        out += [chunk({"content": text[i : i + 8]}) for i in range(0, len(text), 8)]
    out.append(chunk({}, whole["choices"][0]["finish_reason"]))
    if (body.get("stream_options") or {}).get("include_usage"):
        out.append({**base, "choices": [], "usage": whole["usage"]})
    return out


def completion_reply(body: dict) -> dict:
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    return {
        "id": f"cmpl-{next(_ids)}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.get("model", MODEL),
        "choices": [
            {"index": i, "text": " Paris.", "finish_reason": "stop", "logprobs": None}
            for i in range(len(prompts))
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }


def responses_reply(body: dict) -> dict:
    items = body["input"] if isinstance(body["input"], list) else []
    answered = items and items[-1].get("type") == "function_call_output"
    tools = [t for t in body.get("tools") or [] if t.get("type") == "function"]
    if tools and not answered and body.get("tool_choice") != "none":
        args = json.dumps(example(tools[0].get("parameters", {})))
        n = next(_ids)
        output = {
            "type": "function_call",
            "id": f"fc_{n}",
            "call_id": f"call_{n}",
            "name": tools[0]["name"],
            "arguments": args,
            "status": "completed",
        }
    else:
        output = {
            "type": "message",
            "id": f"msg_{next(_ids)}",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": TEXT, "annotations": []}],
        }
    return {
        "id": f"resp_{next(_ids)}",
        "object": "response",
        "created_at": int(time.time()),
        "model": body.get("model", MODEL),
        "status": "completed",
        "output": [output],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools", []),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "metadata": {},
        "text": {"format": {"type": "text"}},
        "usage": {
            "input_tokens": 12,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 8,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 20,
        },
    }


def responses_events(body: dict) -> list[dict]:
    whole = responses_reply(body)
    started = {**whole, "status": "in_progress", "output": [], "usage": None}
    events = [
        {"type": "response.created", "response": started},
        {"type": "response.in_progress", "response": started},
    ]
    for i, item in enumerate(whole["output"]):
        events.append({"type": "response.output_item.added", "output_index": i, "item": item})
        events.append({"type": "response.output_item.done", "output_index": i, "item": item})
    events.append({"type": "response.completed", "response": whole})
    return [{**e, "sequence_number": n} for n, e in enumerate(events)]


# ---- the stub server --------------------------------------------------------------------------


class Stub(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.captured: list[dict] = []
        self.lock = threading.Lock()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def take(self) -> list[dict]:
        with self.lock:
            out, self.captured = self.captured, []
        return out


class Handler(BaseHTTPRequestHandler):
    server: Stub

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        size = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(size) or b"{}")
        with self.server.lock:
            self.server.captured.append({"method": "POST", "path": self.path, "body": body})
        route = self.path.split("?")[0].removeprefix("/v1")
        if route == "/chat/completions":
            self._answer(body, chat_reply, chat_chunks, done=True)
        elif route == "/completions":
            self._answer(body, completion_reply, lambda b: [completion_reply(b)], done=True)
        elif route == "/responses":
            self._answer(body, responses_reply, responses_events, done=False)
        else:
            self._send(404, {"error": {"message": f"no route {route}", "type": "not_found"}})

    def _answer(self, body: dict, whole, stream, done: bool) -> None:
        if not body.get("stream"):
            self._send(200, whole(body))
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        self.end_headers()
        for event in stream(body):
            name = f"event: {event['type']}\n" if "type" in event else ""
            self.wfile.write(f"{name}data: {json.dumps(event)}\n\n".encode())
        if done:
            self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


# ---- what each library sends ------------------------------------------------------------------


class City(BaseModel):
    """A city and the country it is in."""

    name: str
    country: str
    population: int


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"21 C and sunny in {city}"


def get_time(city: str) -> str:
    """The local time in a city."""
    return f"It is noon in {city}"


def record_instructor(url: str, save) -> None:
    import instructor
    import openai

    ask = [{"role": "user", "content": "Paris is the capital of France, 2 million people."}]
    for mode, name in [
        (instructor.Mode.TOOLS, "tools"),
        (instructor.Mode.JSON_SCHEMA, "json_schema"),
        (instructor.Mode.JSON, "json"),
    ]:
        client = instructor.from_openai(openai.OpenAI(base_url=url, api_key=API_KEY), mode=mode)
        city = client.chat.completions.create(
            model=MODEL, response_model=City, messages=ask, max_retries=0
        )
        assert isinstance(city, City)
        save(name)


def record_langchain(url: str, save) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI, OpenAI

    chat = ChatOpenAI(model=MODEL, base_url=url, api_key=API_KEY, temperature=0)
    assert chat.invoke("What is the capital of France?").content
    save("invoke")
    assert "".join(c.content for c in chat.stream("What is the capital of France?"))
    save("stream")
    weather = tool(get_weather)
    reply = chat.bind_tools([weather]).invoke("What is the weather in Paris?")
    assert reply.tool_calls
    save("bind_tools")
    for method in ("function_calling", "json_schema"):
        city = chat.with_structured_output(City, method=method).invoke("Tell me about Paris.")
        assert isinstance(city, City)
        save(f"structured_{method}")
    # the knobs users set: reasoning effort, service tier, prompt cache key, one call at a time
    tuned = ChatOpenAI(
        model=MODEL, base_url=url, api_key=API_KEY, reasoning_effort="low", service_tier="auto"
    )
    bound = tuned.bind_tools([weather], parallel_tool_calls=False)
    assert bound.invoke("What is the weather in Paris?", prompt_cache_key="weather").tool_calls
    save("settings")
    llm = OpenAI(model=MODEL, base_url=url, api_key=API_KEY, max_tokens=16)
    assert len(llm.batch(["The capital of France is", "The capital of Spain is"])) == 2
    save("completions_batch")


def record_pydantic_ai(url: str, save) -> None:
    from pydantic_ai import Agent, NativeOutput, ToolOrOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=url, api_key=API_KEY))
    agent = Agent(model, tools=[get_weather], instructions="Use the tools.")
    assert agent.run_sync("What is the weather in Paris?").output
    save("agent_tool")
    assert isinstance(Agent(model, output_type=City).run_sync("Tell me about Paris.").output, City)
    save("output_tool")
    native = Agent(model, output_type=NativeOutput(City))
    assert isinstance(native.run_sync("Tell me about Paris.").output, City)
    save("output_native")

    async def streamed() -> str:
        async with Agent(model).run_stream("What is the capital of France?") as result:
            return "".join([t async for t in result.stream_text(delta=True)])

    assert asyncio.run(streamed())
    save("stream")
    # only get_weather offered this turn (an allowed_tools choice), with the usual knobs
    settings = {
        "tool_choice": ToolOrOutput(function_tools=["get_weather"]),
        "parallel_tool_calls": False,
        "openai_reasoning_effort": "low",
        "openai_service_tier": "auto",
        "openai_prompt_cache_key": "weather",
    }
    agent = Agent(model, tools=[get_weather, get_time], model_settings=settings)
    assert agent.run_sync("What is the weather in Paris?").output
    save("settings", turns=1)
    prediction = {"type": "content", "content": "The capital of France is Paris."}
    agent = Agent(model, model_settings={"openai_prediction": prediction})
    assert agent.run_sync("What is the capital of France?").output
    save("prediction")


def record_agents(url: str, save) -> None:
    import agents
    import openai
    from openai.types.shared import Reasoning

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=url, api_key=API_KEY)
    tool = agents.function_tool(get_weather)
    for model, name in [
        (agents.OpenAIResponsesModel(model=MODEL, openai_client=client), "responses_tool"),
        (agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client), "chat_tool"),
    ]:
        agent = agents.Agent(
            name="weather", instructions="Use the tool.", tools=[tool], model=model
        )
        result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?"))
        assert result.final_output
        save(name)
    responses = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    # the settings the live test runs with: the first turn must call the tool
    settings = agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=48)
    agent = agents.Agent(name="weather", tools=[tool], model=responses, model_settings=settings)
    assert asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?")).final_output
    save("responses_settings", turns=1)
    chat = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    settings = agents.ModelSettings(
        reasoning=Reasoning(effort="low"),
        parallel_tool_calls=False,
        store=False,
        metadata={"app": "weather"},
        include_usage=True,
    )
    agent = agents.Agent(name="weather", tools=[tool], model=chat, model_settings=settings)
    assert asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?")).final_output
    save("chat_settings", turns=1)
    agent = agents.Agent(name="plain", instructions="Be brief.", model=responses)

    async def streamed():
        result = agents.Runner.run_streamed(agent, "What is the capital of France?")
        async for _ in result.stream_events():
            pass
        return result.final_output

    assert asyncio.run(streamed())
    save("responses_stream")


LIBRARIES = {
    "instructor": ("instructor", record_instructor),
    "langchain": ("langchain-openai", record_langchain),
    "pydantic_ai": ("pydantic-ai-slim", record_pydantic_ai),
    "openai_agents": ("openai-agents", record_agents),
}


def main(names: list[str]) -> None:
    stub = Stub()
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    for folder, (dist, record) in LIBRARIES.items():
        if names and folder not in names:
            continue
        out = HERE / folder
        out.mkdir(exist_ok=True)

        def save(name: str, turns: int | None = None, folder=folder, dist=dist, out=out) -> None:
            """Write what was sent since the last save; `turns`: only the first so many."""
            captured = stub.take()
            assert captured, f"{folder}/{name}: nothing was sent"
            for i, request in enumerate(captured[:turns]):
                path = out / (f"{name}.json" if i == 0 else f"{name}.{i + 1}.json")
                request |= {
                    "library": folder,
                    "library_version": version(dist),
                    "openai_version": version("openai"),
                }
                path.write_text(json.dumps(request, indent=2) + "\n")
                print(path.relative_to(HERE))

        stub.take()
        record(stub.base_url, save)
    stub.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
