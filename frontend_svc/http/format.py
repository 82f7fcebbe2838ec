"""OpenAI response bodies and stream chunks built from a request's StreamDeltas."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from common.convert import TokenLogprobs
from frontend_svc.client_request import StreamDelta
from frontend_svc.http.tool_parser import (
    CallDelta,
    NamedCallParser,
    ParsedDelta,
    ToolCallParser,
    assemble,
)
from frontend_svc.http.tools import ToolPlan

MIN_LOGPROB = -9999.0  # stands for -inf (JSON has no infinities), as vLLM does


def _lp(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB  # also maps NaN


def _call_delta(delta: CallDelta) -> dict:
    """A stream's tool call delta: the id, type and name come once, with the first fragment."""
    if delta.id is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    return {
        "index": delta.index,
        "id": delta.id,
        "type": "function",
        "function": {"name": delta.name, "arguments": delta.arguments},
    }


def _function_call_delta(delta: CallDelta) -> dict:
    """The legacy `function_call` of a stream (one call, no id): the name comes once."""
    if delta.id is None:
        return {"arguments": delta.arguments}
    return {"name": delta.name, "arguments": delta.arguments}


def _message_delta(parsed: ParsedDelta, legacy: bool) -> dict:
    delta: dict = {}
    if parsed.content:
        delta["content"] = parsed.content
    if parsed.calls and legacy:
        delta["function_call"] = _function_call_delta(parsed.calls[0])
    elif parsed.calls:
        delta["tool_calls"] = [_call_delta(c) for c in parsed.calls]
    return delta


def _finish_with_calls(finish: str | None, called: bool, legacy: bool) -> str | None:
    """`tool_calls` (`function_call` for a request that sent `functions`) when the output ended
    by itself after a call; `length` stays `length`."""
    if called and finish == "stop":
        return "function_call" if legacy else "tool_calls"
    return finish


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass(slots=True)
class ResponseFormatter:
    """Knows one request's id, model and kind; turns deltas into OpenAI JSON objects."""

    chat: bool
    request_id: str
    model: str
    prompt_tokens: int
    tokenizer: object
    want_logprobs: bool = False
    echo_text: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    text_offset: int = 0  # completions logprobs: characters before the next token
    index: int = 0  # the choice (n > 1)
    tools: ToolPlan | None = None  # chat with tools: calls are read out of the output
    _stream_parser: ToolCallParser | NamedCallParser | None = field(default=None, repr=False)

    @property
    def reads_calls(self) -> bool:
        return self.chat and self.tools is not None and self.tools.choice != "none"

    @property
    def legacy(self) -> bool:
        return self.tools is not None and self.tools.legacy

    def _new_parser(self) -> ToolCallParser | NamedCallParser:
        parser = self.tools.parser() if self.tools is not None else None
        assert parser is not None, "only a formatter that reads calls parses them"
        return parser

    # ---- pieces ---------------------------------------------------------------------------
    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _chat_logprob(self, token_id: int, logprob: float) -> dict:
        text = self._token_text(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode())}

    def logprobs(self, entries: list[TokenLogprobs] | None) -> dict | None:
        if not self.want_logprobs:
            return None
        entries = entries or []
        if self.chat:
            return {
                "content": [
                    {
                        **self._chat_logprob(e.token_id, e.logprob),
                        "top_logprobs": [self._chat_logprob(t, lp) for t, lp in e.top],
                    }
                    for e in entries
                ]
            }
        tokens, offsets = [], []
        for e in entries:
            text = self._token_text(e.token_id)
            tokens.append(text)
            offsets.append(self.text_offset)
            self.text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [_lp(e.logprob) for e in entries],
            "top_logprobs": [{self._token_text(t): _lp(lp) for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _head(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    # ---- streaming ------------------------------------------------------------------------
    def first_chat_chunk(self) -> dict:
        # null, not "": the content of a message that only calls stays null once assembled
        content = None if self.reads_calls else ""
        return {
            **self._head("chat.completion.chunk"),
            "choices": [
                {
                    "index": self.index,
                    "delta": {"role": "assistant", "content": content},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }

    def chunk(self, delta: StreamDelta, text_prefix: str = "") -> dict:
        finish = str(delta.finish_reason) if delta.finish_reason is not None else None
        text = text_prefix + delta.text
        choice: dict = {"index": self.index}
        if self.reads_calls:
            if self._stream_parser is None:
                self._stream_parser = self._new_parser()
            parsed = self._stream_parser.feed(text)
            if finish is not None:
                parsed.extend(self._stream_parser.finish())
                finish = _finish_with_calls(finish, self._stream_parser.called, self.legacy)
            choice["delta"] = _message_delta(parsed, self.legacy)
        elif self.chat:
            choice["delta"] = {"content": text} if text or finish is None else {}
        else:
            choice["text"] = text
        choice["logprobs"] = self.logprobs(delta.logprobs)
        choice["finish_reason"] = finish
        if finish is not None:
            choice["stop_reason"] = delta.stop_reason
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [choice]}

    def usage_chunk(self, completion_tokens: int) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {
            **self._head(obj),
            "choices": [],
            "usage": usage(self.prompt_tokens, completion_tokens),
        }

    # ---- whole response -------------------------------------------------------------------
    def response(self, deltas: list[StreamDelta]) -> dict:
        text = self.echo_text + "".join(d.text for d in deltas)
        last = deltas[-1] if deltas else None
        entries = [e for d in deltas for e in (d.logprobs or ())]
        finish = str(last.finish_reason) if last and last.finish_reason is not None else None
        completion_tokens = last.num_output_tokens if last else 0
        choice: dict = {"index": self.index}
        if self.reads_calls:
            choice["message"], finish = self._message_with_calls(text, finish)
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self.logprobs(entries)
        choice["finish_reason"] = finish
        choice["stop_reason"] = last.stop_reason if last else None
        obj = "chat.completion" if self.chat else "text_completion"
        return {
            **self._head(obj),
            "choices": [choice],
            "usage": usage(self.prompt_tokens, completion_tokens),
        }

    def _message_with_calls(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        parser = self._new_parser()
        content, calls = assemble(parser.feed(text).extend(parser.finish()))
        message: dict = {"role": "assistant", "content": content or None}
        if calls and self.legacy:
            message["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
        elif calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in calls
            ]
        return message, _finish_with_calls(finish, parser.called, self.legacy)
