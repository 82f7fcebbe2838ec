"""A chat output's text -> the message content and tool calls, incrementally for streaming.

The parser is fed the output as it is generated and answers each piece with what may be sent
now: content text and call deltas (a call's id and name once, then fragments of its arguments).
What it returns does not depend on how the text was split; the whole response is the same
parser fed the whole text. Formats read:

- `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen), anywhere;
  text outside the blocks is the content;
- a bare object `{"name": ..., "arguments": ...}` or an array of them, when the output starts
  with it and the (first) name is one of the request's tools (Llama 3.1's JSON calls, and the
  array that `tool_choice: "required"` constrains the output to); `parameters` is read as
  `arguments`;
- with a named `tool_choice` the whole output is the arguments of that one call.

Whitespace around calls is not content: whitespace is held back until text follows it, and
dropped at the end when calls were made. A block that is not a call (bad JSON, no name) is given
back as content; a call already started stays, with the arguments streamed so far.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import dataclass, field

from frontend_svc.http.call_scanner import WHITESPACE, CallObjectScanner

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class CallDelta:
    """Part of call `index`: its id and name come once, in its first delta."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def add_content(self, text: str) -> None:
        self.content += text

    def add_call(self, delta: CallDelta) -> None:
        last = self.calls[-1] if self.calls else None
        if last is not None and last.index == delta.index and delta.id is None:
            last.arguments += delta.arguments
        else:
            self.calls.append(delta)

    def extend(self, other: ParsedDelta) -> ParsedDelta:
        self.add_content(other.content)
        for delta in other.calls:
            self.add_call(delta)
        return self


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str


def assemble(parsed: ParsedDelta) -> tuple[str, list[ToolCall]]:
    """Everything one output produced -> its content and whole calls."""
    calls: list[ToolCall] = []
    for delta in parsed.calls:
        if delta.id is not None:
            calls.append(ToolCall(delta.id, delta.name or "", delta.arguments))
        else:
            calls[delta.index].arguments += delta.arguments
    return parsed.content, calls


# ---- the output text ------------------------------------------------------------------------
_LEAD, _TEXT, _BLOCK, _BLOCK_TAIL, _BARE_OBJECT, _BARE_ARRAY = range(6)


class ToolCallParser:
    """Content and calls out of free text (tool_choice auto, and required's JSON array).

    `known_names`: the request's functions; a bare JSON object is a call only if it names one.
    `parallel`: False keeps the first call and drops any later one."""

    def __init__(self, known_names: Collection[str], parallel: bool = True) -> None:
        self.known_names = frozenset(known_names)
        self.parallel = parallel
        self.mode = _LEAD
        self.held = ""  # not sent yet: whitespace, or what may be the start of a tag
        self.candidate: list[str] = []  # the raw text of a call being read, given back if not
        self.scanner: CallObjectScanner | None = None
        self.array_expects_item = False
        self.broken_block = False  # a started call's JSON went wrong: skip to the closing tag
        self.calls = 0
        self.current: int | None = None  # index of the call being read; None: not started
        self.dropped = False  # the call being read comes after the first, with parallel off
        self.early_arguments: list[str] = []  # read before the name
        self.content_sent = False
        self.out = ParsedDelta()

    @property
    def called(self) -> bool:
        return self.calls > 0

    def feed(self, text: str) -> ParsedDelta:
        while text:
            text = self._step(text)
        return self._take()

    def finish(self) -> ParsedDelta:
        """The end of the output: what was held back, as content or dropped."""
        if self.mode in (_BLOCK, _BARE_OBJECT, _BARE_ARRAY) and self.current is None:
            self._give_back()
        if self.mode == _BLOCK_TAIL:
            self.held = ""  # the start of a closing tag
        if self.held.strip(WHITESPACE) or not self.called:
            self.out.add_content(self.held)
        self.held = ""
        return self._take()

    def _take(self) -> ParsedDelta:
        out, self.out = self.out, ParsedDelta()
        return out

    def _step(self, text: str) -> str:
        mode = self.mode
        if mode == _LEAD:
            return self._lead(text)
        if mode == _TEXT:
            return self._text(text)
        if mode == _BLOCK_TAIL:
            return self._block_tail(text)
        if mode == _BARE_ARRAY and self.scanner is None:
            return self._between_items(text)
        return self._scan(text)

    # ---- plain text -----------------------------------------------------------------------
    def _lead(self, text: str) -> str:
        stripped = text.lstrip(WHITESPACE)
        self.held += text[: len(text) - len(stripped)]
        if not stripped:
            return ""
        if stripped[0] == "{":
            self.mode = _BARE_OBJECT
            self._read_call([self.held])
        elif stripped[0] == "[":
            self.mode = _BARE_ARRAY
            self.candidate = [self.held, "["]
            self.scanner = None
            self.array_expects_item = True
            stripped = stripped[1:]
        else:
            self.mode = _TEXT
            return stripped
        self.held = ""
        return stripped

    def _text(self, text: str) -> str:
        text = self.held + text
        self.held = ""
        at = text.find(CALL_OPEN)
        if at >= 0:
            self._content(text[:at])
            self.mode = _BLOCK
            self._read_call([CALL_OPEN])
            return text[at + len(CALL_OPEN) :]
        keep = _partial_tag(text, CALL_OPEN)
        self._content(text[: len(text) - keep])
        self.held += text[len(text) - keep :]
        return ""

    def _content(self, text: str) -> None:
        """Send text, but hold its trailing whitespace until more text follows."""
        text = self.held + text
        if self.called and not self.content_sent:
            text = text.lstrip(WHITESPACE)
        body = text.rstrip(WHITESPACE)
        self.held = text[len(body) :]
        if body:
            self.out.add_content(body)
            self.content_sent = True

    def _block_tail(self, text: str) -> str:
        """After a block's object: whitespace, then `</tool_call>` (or a new block)."""
        text = self.held + text
        self.held = ""
        if self.broken_block:
            at = text.find(CALL_CLOSE)
            if at < 0:
                self.held = text[len(text) - _partial_tag(text, CALL_CLOSE) :]
                return ""
            self.broken_block = False
            self.mode = _TEXT
            return text[at + len(CALL_CLOSE) :]
        text = text.lstrip(WHITESPACE)
        for tag, mode in ((CALL_CLOSE, _TEXT), (CALL_OPEN, _BLOCK)):
            if text.startswith(tag):
                self.mode = mode
                if mode == _BLOCK:
                    self._read_call([CALL_OPEN])
                return text[len(tag) :]
            if tag.startswith(text):
                self.held = text
                return ""
        self.mode = _TEXT  # no closing tag: what follows is text
        return text

    # ---- a call object (in a block, bare, or in a bare array) -----------------------------
    def _read_call(self, candidate: list[str]) -> None:
        self.scanner = CallObjectScanner()
        self.candidate = candidate
        self.current = None
        self.dropped = False
        self.early_arguments = []

    def _scan(self, text: str) -> str:
        scanner = self.scanner
        assert scanner is not None
        for i, ch in enumerate(text):
            if self.current is None:
                self.candidate.append(ch)
            scanner.push(ch)
            self._collect(scanner)
            if not self._still_a_call(scanner):
                self._give_back()
                return text[i + 1 :]
            if scanner.finished:
                self._object_ended(scanner)
                return text[i + 1 :]
        return ""

    def _still_a_call(self, scanner: CallObjectScanner) -> bool:
        """A bare object is a call only if its first key is the name of one of the tools; once
        a call has started (its name sent) it stays one."""
        if self.current is not None:
            return True
        if scanner.failed:
            return False
        if self.mode == _BLOCK or (self.mode == _BARE_ARRAY and self.called):
            return True
        if scanner.first_key is not None and scanner.first_key != "name":
            return False
        return scanner.name is None or scanner.name in self.known_names

    def _collect(self, scanner: CallObjectScanner) -> None:
        if self.current is None and scanner.name is not None and self._still_a_call(scanner):
            self._start_call(scanner.name)
        if scanner.arguments_out:
            fragment = "".join(scanner.arguments_out)
            scanner.arguments_out.clear()
            if self.current is None:
                self.early_arguments.append(fragment)
            elif not self.dropped:
                self.out.add_call(CallDelta(self.current, fragment))

    def _start_call(self, name: str) -> None:
        self.candidate = []
        self.held = ""  # whitespace before a call is not content
        if self.called and not self.parallel:
            self.current, self.dropped = -1, True
            return
        self.current = self.calls
        self.calls += 1
        arguments = "".join(self.early_arguments)
        self.out.add_call(CallDelta(self.current, arguments, new_call_id(), name))

    def _object_ended(self, scanner: CallObjectScanner) -> None:
        self.scanner = None
        if self.mode == _BLOCK:
            self.mode = _BLOCK_TAIL
            self.broken_block = scanner.failed
        elif self.mode == _BARE_OBJECT or scanner.failed:
            self.mode = _TEXT
        else:
            self.array_expects_item = False

    def _between_items(self, text: str) -> str:
        """A bare array, outside its items: `,` and `]` (and `{`, the next item)."""
        for i, ch in enumerate(text):
            if ch in WHITESPACE:
                if not self.called:
                    self.candidate.append(ch)
                continue
            if self.array_expects_item and ch == "{":
                self._read_call(self.candidate if not self.called else [])
                return text[i:]
            if not self.array_expects_item and ch == ",":
                self.array_expects_item = True
                continue
            if not self.called:
                self.candidate.append(ch)
                self._give_back()
                return text[i + 1 :]
            self.mode = _TEXT
            return text[i + 1 :] if ch == "]" and not self.array_expects_item else text[i:]
        return ""

    def _give_back(self) -> None:
        """What looked like a call is not one: its text is content (an unfinished item after a
        bare array's calls is dropped)."""
        text = "".join(self.candidate)
        dropped = self.mode == _BARE_ARRAY and self.called
        self.scanner = None
        self.candidate = []
        self.mode = _TEXT
        if text and not dropped:
            self._content(text)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class NamedCallParser:
    """tool_choice names the function: the whole output is that call's arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    @property
    def called(self) -> bool:
        return self.started

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if not text:
            return out
        if self.started:
            out.add_call(CallDelta(0, text))
        else:
            self.started = True
            out.add_call(CallDelta(0, text, new_call_id(), self.name))
        return out

    def finish(self) -> ParsedDelta:
        return ParsedDelta()
