"""Tool calls over the HTTP app in-process: a real tokenizer and a worker that answers every
request with a scripted text, read back by the official client's own types and stream state."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from common.tokenizer import load_tokenizer
from frontend_svc.http import create_app
from frontend_svc.intake import Intake
from scheduler_svc.core import SchedulerOutput
from scheduler_svc.engine.worker_session import ExecuteTransport, StepReply
from tests.engine_fakes import TOKENIZER_VOCAB, http_context, make_engine, registration, run_session

TOK = load_tokenizer(None)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
        "strict": True,
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class ScriptedWorker(ExecuteTransport):
    """Samples `text`'s tokens, then EOS, for every request (the constraint is not applied)."""

    def __init__(self, text: str) -> None:
        self.script = [*TOK.encode(text, add_special_tokens=False), TOK.eos_token_id]
        self.prompt_len: dict[str, int] = {}
        self.output: dict[str, list[int]] = {}
        self.prompts: list[str] = []
        self.constraints: list = []  # each new request's StructuredOutput (None: free)

    async def execute(self, out: SchedulerOutput) -> StepReply:
        await asyncio.sleep(0)
        computed = {}
        for new in out.new_requests:
            self.prompt_len[new.request_id] = len(new.prompt_token_ids)
            self.output[new.request_id] = list(new.output_token_ids)
            self.prompts.append(TOK.decode(new.prompt_token_ids, skip_special_tokens=False))
            self.constraints.append(new.sampling_params.structured)
            computed[new.request_id] = new.num_computed_tokens
        for cached in out.cached_requests:
            computed[cached.request_id] = cached.num_computed_tokens
            if cached.resumed:
                self.output[cached.request_id] = list(cached.new_token_ids)
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            output = self.output[rid]
            if computed[rid] + n >= self.prompt_len[rid] + len(output):
                token = self.script[min(len(output), len(self.script) - 1)]
                output.append(token)
                sampled[rid] = [token]
            else:
                sampled[rid] = []
        return StepReply(sampled)


def post(text: str, payload: dict) -> tuple[httpx.Response, ScriptedWorker]:
    worker = ScriptedWorker(text)

    async def main():
        engine = make_engine(TOKENIZER_VOCAB)
        ctx = http_context(engine, Intake(TOK, "fake", {"fake"}, 512))
        session = engine.attach(registration("w0", num_blocks=256), worker)
        task = asyncio.create_task(run_session(engine, session))
        transport = httpx.ASGITransport(app=create_app(ctx))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return await client.post("/v1/chat/completions", json=payload)
        finally:
            session.mark_lost("test over")
            await task

    return asyncio.run(main()), worker


def chunks(response: httpx.Response) -> list[ChatCompletionChunk]:
    out = []
    for block in response.text.split("\n\n"):
        data = block.removeprefix("data: ")
        if data and data != "[DONE]":
            out.append(ChatCompletionChunk.model_validate(json.loads(data)))
    return out


def both_ways(text: str, payload: dict):
    """The whole response and the stream assembled by the client's ChatCompletionStreamState,
    as the client's own types."""
    whole, worker = post(text, {"messages": USER, "temperature": 0, **payload})
    assert whole.status_code == 200, whole.text
    streamed, _ = post(text, {"messages": USER, "temperature": 0, "stream": True, **payload})
    assert streamed.status_code == 200, streamed.text
    state = ChatCompletionStreamState(input_tools=payload.get("tools", []))
    for chunk in chunks(streamed):
        state.handle_chunk(chunk)
    return ChatCompletion.model_validate(whole.json()), state.get_final_completion(), worker


def calls_of(completion) -> list[tuple[str, dict]]:
    message = completion.choices[0].message
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_auto_reads_a_tool_call_block_out_of_the_output_streamed_and_not():
    whole, streamed, worker = both_ways(f"Let me check.\n{CALL}", {"tools": [WEATHER, CLOCK]})
    for completion in (whole, streamed):
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me check."
        assert calls_of(completion) == [("get_weather", {"city": "Paris"})]
        assert choice.message.tool_calls[0].id.startswith("call_")
    assert streamed.choices[0].message.tool_calls[0].function.parsed_arguments == {"city": "Paris"}
    assert "<tools>" in worker.prompts[0] and '"name": "get_weather"' in worker.prompts[0]


def test_auto_without_a_call_is_a_plain_answer():
    whole, streamed, _ = both_ways(" It is sunny in Paris. ", {"tools": [WEATHER]})
    for completion in (whole, streamed):
        choice = completion.choices[0]
        assert choice.finish_reason == "stop" and not choice.message.tool_calls
        assert choice.message.content == " It is sunny in Paris. "


def test_stream_sends_the_call_header_once_then_argument_fragments():
    response, _ = post(CALL, {"messages": USER, "tools": [WEATHER], "stream": True})
    deltas = [c.choices[0].delta for c in chunks(response) if c.choices]
    assert deltas[0].role == "assistant" and deltas[0].content is None
    parts = [tc for d in deltas for tc in d.tool_calls or []]
    assert parts[0].id and parts[0].function.name == "get_weather" and parts[0].type == "function"
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in parts[1:])
    assert len(parts) > 2  # the arguments came in pieces
    assert "".join(p.function.arguments for p in parts) == '{"city": "Paris"}'
    assert not any(d.content for d in deltas)


def test_required_and_named_choices_constrain_and_read_the_call():
    array = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    whole, streamed, _ = both_ways(array, {"tools": [WEATHER, CLOCK], "tool_choice": "required"})
    for completion in (whole, streamed):
        assert completion.choices[0].finish_reason == "tool_calls"
        assert completion.choices[0].message.content is None
        assert calls_of(completion) == [("get_weather", {"city": "Paris"})]
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole, streamed, _ = both_ways('{"city": "Paris"}', {"tools": [WEATHER], "tool_choice": named})
    for completion in (whole, streamed):
        assert completion.choices[0].finish_reason == "tool_calls"
        assert calls_of(completion) == [("get_weather", {"city": "Paris"})]


def test_a_call_cut_by_max_tokens_finishes_with_length():
    response, _ = post(
        CALL, {"messages": USER, "tools": [WEATHER], "tool_choice": "auto", "max_tokens": 20}
    )
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and '{"city": "Paris"}'.startswith(call["arguments"])


def test_tool_choice_none_answers_in_text_with_the_tools_shown():
    response, worker = post(CALL, {"messages": USER, "tools": [WEATHER], "tool_choice": "none"})
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == CALL
    assert "<tools>" in worker.prompts[0]


def test_each_of_n_choices_has_its_own_calls():
    response, _ = post(CALL * 2, {"messages": USER, "tools": [WEATHER], "n": 3, "temperature": 1})
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    ids = [call["id"] for c in choices for call in c["message"]["tool_calls"]]
    assert len(ids) == 6 == len(set(ids))
    streamed, _ = post(
        CALL, {"messages": USER, "tools": [WEATHER], "n": 2, "temperature": 1, "stream": True}
    )
    state = ChatCompletionStreamState()
    for chunk in chunks(streamed):
        state.handle_chunk(chunk)
    final = state.get_final_completion()
    assert [c.finish_reason for c in final.choices] == ["tool_calls"] * 2
    assert all(c.message.tool_calls[0].function.name == "get_weather" for c in final.choices)


def test_a_follow_up_turn_renders_the_calls_and_the_results():
    call = {
        "id": "call_abc",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "21 C and sunny"},
    ]
    response, worker = post("It is 21 C.", {"messages": messages, "tools": [WEATHER]})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "It is 21 C."
    prompt = worker.prompts[0]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert '"tool_call_id": "call_abc", "content": "21 C and sunny"' in prompt


@pytest.mark.parametrize(
    "payload,param",
    [
        ({"tools": [{"type": "function"}]}, "tools.0.function"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "function": {"name": "f", "paramaters": {}}}]}, "tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]},
            None,
        ),
        (
            {"messages": [{"role": "user", "content": "hi", "tool_calls": [{"id": "c"}]}]},
            "messages.0.tool_calls",
        ),
    ],
)
def test_bad_tool_bodies_are_400s_with_the_field_named(payload, param):
    response, worker = post("x", {"messages": USER, **payload})
    if param is None:  # an empty tool_calls list is no calls
        assert response.status_code == 200, response.text
        return
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] and error["param"].startswith(param), error
    assert error["code"] == "invalid_request" and error["message"]
    assert worker.prompts == []  # nothing ran
