"""The request bodies that instructor, LangChain, pydantic-ai and the OpenAI Agents SDK send
(recorded from the libraries by tests/data/client_bodies/record.py), replayed against the HTTP
app in-process: each is accepted, answered in a shape the library reads, and reaches the worker
with the output constraint its tools or format ask for.

The worker plays a model that follows the rules: under a constraint it writes a value of the
constraint's schema; free, it calls the first tool when the body offers tools and no tool has
answered yet, and otherwise answers in plain text."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from common.tokenizer import load_tokenizer
from frontend_svc.http import create_app
from frontend_svc.intake import Intake
from scheduler_svc.core import SchedulerOutput
from scheduler_svc.engine.worker_session import ExecuteTransport, StepReply
from tests.engine_fakes import TOKENIZER_VOCAB, http_context, make_engine, registration, run_session

TOK = load_tokenizer(None)
MODEL = "fake"  # the recorded bodies name it
API_KEY = "replay-key"
BODIES = Path(__file__).resolve().parents[2] / "data" / "client_bodies"
RECORDED = sorted(BODIES.glob("*/*.json"))
TEXT = "It is 21 C and sunny in Paris."


def example(schema: dict, defs: dict | None = None) -> Any:
    """A value of a (simple, pydantic-made) JSON schema: the model's answer under it."""
    defs = schema.get("$defs", {}) if defs is None else defs
    if "$ref" in schema:
        return example(defs[schema["$ref"].rsplit("/", 1)[-1]], defs)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return example(schema[key][0], defs)
    kind = schema.get("type", "object")
    if kind == "object":
        return {k: example(v, defs) for k, v in schema.get("properties", {}).items()}
    if kind == "array":
        return [example(schema.get("items", {"type": "string"}), defs)]
    return {"string": "Paris", "integer": 2, "number": 21.5, "boolean": True}[kind]


# ---- what a body asks for ---------------------------------------------------------------------


def functions(body: dict) -> dict[str, dict]:
    """The body's function tools: name -> parameters schema (chat and Responses forms)."""
    out = {}
    for tool in body.get("tools") or []:
        if tool.get("type") == "function":
            fn = tool.get("function", tool)
            out[fn["name"]] = fn.get("parameters") or {"type": "object", "properties": {}}
    return out


def answered(body: dict) -> bool:
    """A tool result is the last thing the model was sent."""
    if "messages" in body:
        return body["messages"][-1].get("role") == "tool"
    items = body["input"] if isinstance(body["input"], list) else []
    return bool(items) and items[-1].get("type") == "function_call_output"


def choice_and_tools(body: dict) -> tuple[str | dict, dict[str, dict]]:
    """The tool_choice, an allowed_tools one read as its mode, and the tools the model may
    call."""
    tools, choice = functions(body), body.get("tool_choice", "auto")
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        allowed = {t.get("function", t)["name"] for t in choice["allowed_tools"]["tools"]}
        return choice["allowed_tools"]["mode"], {k: v for k, v in tools.items() if k in allowed}
    return choice, tools


def expected_call(body: dict) -> str | None:
    """The tool the answer calls: a named choice's, else the first one, unless the choice is
    none or a tool has answered (then the model answers, under `auto`)."""
    choice, tools = choice_and_tools(body)
    if not tools or choice == "none":
        return None
    if isinstance(choice, dict):
        return choice.get("function", choice).get("name")
    if choice == "auto" and answered(body):
        return None
    return next(iter(tools))


def answer_format(body: dict) -> dict | None:
    """The response_format (chat) or text.format (Responses) the answer must take, if any."""
    fmt = body.get("response_format") or (body.get("text") or {}).get("format") or {}
    return fmt if fmt.get("type") in ("json_object", "json_schema") else None


def answer_schema(fmt: dict) -> dict:
    return fmt["json_schema"]["schema"] if "json_schema" in fmt else fmt["schema"]


def expected_constraint(body: dict) -> str | None:
    """The kind of constraint the worker must get: a required or named call is constrained to
    the call (docs/tools.md), `auto` beside a format to a call or the answer, a format alone to
    the format; free otherwise."""
    if body.get("prompt") is not None:
        return None
    (choice, tools), fmt = choice_and_tools(body), answer_format(body)
    if tools and (choice == "required" or isinstance(choice, dict)):
        return "json_schema"
    if tools and choice == "auto" and fmt:
        return "any_of"
    return fmt["type"] if fmt else None


# ---- the model --------------------------------------------------------------------------------


class Player(ExecuteTransport):
    """Answers each request as `answer(body, its constraint)` says, then EOS; keeps each new
    request's constraint."""

    def __init__(self, body: dict) -> None:
        self.body = body
        self.constraints: list = []
        self.scripts: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}
        self.output: dict[str, list[int]] = {}

    async def execute(self, out: SchedulerOutput) -> StepReply:
        await asyncio.sleep(0)
        computed = {}
        for new in out.new_requests:
            rid, structured = new.request_id, new.sampling_params.structured
            self.constraints.append(structured)
            text = answer(self.body, structured)
            self.scripts[rid] = [*TOK.encode(text, add_special_tokens=False), TOK.eos_token_id]
            self.prompt_len[rid] = len(new.prompt_token_ids)
            self.output[rid] = list(new.output_token_ids)
            computed[rid] = new.num_computed_tokens
        for cached in out.cached_requests:
            computed[cached.request_id] = cached.num_computed_tokens
            if cached.resumed:
                self.output[cached.request_id] = list(cached.new_token_ids)
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            output, script = self.output[rid], self.scripts[rid]
            if computed[rid] + n >= self.prompt_len[rid] + len(output):
                output.append(script[min(len(output), len(script) - 1)])
                sampled[rid] = [output[-1]]
            else:
                sampled[rid] = []
        return StepReply(sampled)


def answer(body: dict, structured) -> str:
    if structured is not None:
        if structured.kind == "json_object":
            return json.dumps({"name": "Paris", "country": "France", "population": 2})
        if structured.kind == "json_schema":
            return json.dumps(example(json.loads(structured.spec)))
        raise AssertionError(f"no answer for a {structured.kind} constraint")
    name = expected_call(body) if "prompt" not in body else None
    if name is None:
        return TEXT
    call = {"name": name, "arguments": example(functions(body)[name])}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def replay(recorded: dict) -> tuple[httpx.Response, Player]:
    player = Player(recorded["body"])

    async def main():
        engine = make_engine(TOKENIZER_VOCAB)
        ctx = http_context(engine, Intake(TOK, MODEL, {MODEL}, 512), API_KEY)
        session = engine.attach(registration("w0", num_blocks=256), player)
        task = asyncio.create_task(run_session(engine, session))
        transport = httpx.ASGITransport(app=create_app(ctx))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                return await http.request(
                    recorded["method"],
                    recorded["path"],
                    json=recorded["body"],
                    headers={"Authorization": f"Bearer {API_KEY}"},
                )
        finally:
            session.mark_lost("test over")
            await task

    return asyncio.run(main()), player


def sse_events(text: str) -> list:
    events = []
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---- what the library reads back --------------------------------------------------------------


def check_answer(body: dict, calls: list[tuple[str, str]], content: str | None) -> None:
    """The answer the body asked for: the expected call with arguments of its tool's schema,
    or content (in the format, when one was asked)."""
    name = expected_call(body)
    if name is not None:
        assert [n for n, _ in calls] == [name], (calls, content)
        jsonschema.validate(json.loads(calls[0][1]), functions(body)[name])
        return
    assert not calls and content, (calls, content)
    fmt = answer_format(body)
    if fmt is not None and fmt["type"] == "json_schema":
        jsonschema.validate(json.loads(content), answer_schema(fmt))
    elif fmt is not None:
        assert isinstance(json.loads(content), dict)


def check_chat(body: dict, r: httpx.Response) -> None:
    if not body.get("stream"):
        out = r.json()
        assert out["object"] == "chat.completion" and out["model"] == MODEL
        (choice,) = out["choices"]
        msg = choice["message"]
        assert msg["role"] == "assistant"
        calls = [
            (c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []
        ]
        assert choice["finish_reason"] == ("tool_calls" if calls else "stop")
        check_answer(body, calls, msg["content"])
        return
    events = sse_events(r.text)
    assert events[-1] == "[DONE]", events[-3:]
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    if (body.get("stream_options") or {}).get("include_usage"):
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
        chunks = chunks[:-1]
    content, calls = "", {}
    for delta in (c["choices"][0]["delta"] for c in chunks):
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            name, args = calls.get(call["index"], ("", ""))
            fn = call.get("function", {})
            calls[call["index"]] = (name + fn.get("name", ""), args + fn.get("arguments", ""))
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "tool_calls")
    check_answer(body, [calls[i] for i in sorted(calls)], content or None)


def check_completion(body: dict, r: httpx.Response) -> None:
    out = r.json()
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    assert out["object"] == "text_completion"
    assert [c["index"] for c in out["choices"]] == list(range(len(prompts)))  # one per prompt
    assert all(c["text"] == TEXT for c in out["choices"])


def check_response_object(body: dict, out: dict) -> None:
    assert out["object"] == "response" and out["status"] == "completed", out
    calls = [(i["name"], i["arguments"]) for i in out["output"] if i["type"] == "function_call"]
    texts = [
        part["text"]
        for item in out["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    ]
    check_answer(body, calls, "".join(texts) or None)


def check_responses(body: dict, r: httpx.Response) -> None:
    if not body.get("stream"):
        check_response_object(body, r.json())
        return
    events = [e for e in sse_events(r.text) if e != "[DONE]"]
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] == "response.completed", [e["type"] for e in events]
    check_response_object(body, events[-1]["response"])


CHECKS = {
    "/v1/chat/completions": check_chat,
    "/v1/completions": check_completion,
    "/v1/responses": check_responses,
}


@pytest.mark.parametrize(
    "path", RECORDED, ids=[str(p.relative_to(BODIES).with_suffix("")) for p in RECORDED]
)
def test_a_recorded_library_body_is_answered_in_the_shape_it_reads(path):
    recorded = json.loads(path.read_text())
    r, player = replay(recorded)
    assert r.status_code == 200, r.text
    body = recorded["body"]
    CHECKS[recorded["path"]](body, r)
    kinds = [c.kind if c is not None else None for c in player.constraints]
    prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
    assert kinds == [expected_constraint(body)] * prompts


def test_the_recordings_cover_every_library_and_route():
    recorded = [json.loads(p.read_text()) for p in RECORDED]
    assert {r["library"] for r in recorded} == {
        "instructor",
        "langchain",
        "pydantic_ai",
        "openai_agents",
    }
    assert {r["path"] for r in recorded} == set(CHECKS)
