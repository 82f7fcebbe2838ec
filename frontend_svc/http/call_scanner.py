"""One JSON tool call object, `{"name": "f", "arguments": {...}}`, read a character at a time
(tool_parser.py feeds it): the name as soon as it is complete, the arguments as fragments while
they stream."""

from __future__ import annotations

import json

ARGUMENT_KEYS = ("arguments", "parameters")
WHITESPACE = " \t\r\n"

_OPEN, _KEY_OR_END, _KEY_START, _KEY, _COLON, _VALUE_START, _VALUE, _AFTER_VALUE = range(8)


class CallObjectScanner:
    """Reads `{"name": "f", "arguments": {...}}` one character at a time. `name` is set once its
    string is complete; `arguments_out` collects the raw text of the arguments value as it
    arrives (a value that is itself a JSON string is decoded and comes whole). `done` once the
    object closes; `failed` on text that is not such an object."""

    __slots__ = (
        "state",
        "raw",
        "key",
        "first_key",
        "value_kind",
        "depth",
        "in_string",
        "escaped",
        "name",
        "arguments_key",
        "arguments_out",
        "done",
        "failed",
    )

    def __init__(self) -> None:
        self.state = _OPEN
        self.raw: list[str] = []
        self.key = ""
        self.first_key: str | None = None
        self.value_kind = ""  # container | string | scalar
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.name: str | None = None
        self.arguments_key: str | None = None
        self.arguments_out: list[str] = []
        self.done = False
        self.failed = False

    @property
    def finished(self) -> bool:
        return self.done or self.failed

    def push(self, ch: str) -> None:
        state = self.state
        if self.done or self.failed:
            return
        if state == _VALUE:
            self._value_char(ch)
        elif ch in WHITESPACE and state != _KEY:
            return
        elif state == _OPEN:
            self._expect(ch == "{", _KEY_OR_END)
        elif state == _KEY_OR_END:
            if ch == "}":
                self._close()
            else:
                self._start_key(ch)
        elif state == _KEY_START:
            self._start_key(ch)
        elif state == _KEY:
            self._key_char(ch)
        elif state == _COLON:
            self._expect(ch == ":", _VALUE_START)
        elif state == _VALUE_START:
            self._start_value(ch)
        elif state == _AFTER_VALUE:
            if ch == ",":
                self.state = _KEY_START
            elif ch == "}":
                self._close()
            else:
                self.failed = True

    def _expect(self, ok: bool, next_state: int) -> None:
        if ok:
            self.state = next_state
        else:
            self.failed = True

    def _start_key(self, ch: str) -> None:
        self.raw = []
        self._expect(ch == '"', _KEY)

    def _key_char(self, ch: str) -> None:
        if self.escaped:
            self.escaped = False
        elif ch == "\\":
            self.escaped = True
        elif ch == '"':
            self.key = _decode_string("".join(self.raw))
            if self.key is None:
                self.failed = True
                return
            if self.first_key is None:
                self.first_key = self.key
            self.state = _COLON
            return
        self.raw.append(ch)

    def _start_value(self, ch: str) -> None:
        self.raw = [ch]
        self.state = _VALUE
        if ch in "{[":
            self.value_kind, self.depth, self.in_string = "container", 1, False
            if self._streams_arguments():
                self.arguments_out.append(ch)
        elif ch == '"':
            self.value_kind, self.in_string = "string", True
        elif ch in "-0123456789tfn":
            self.value_kind = "scalar"
        else:
            self.failed = True

    def _streams_arguments(self) -> bool:
        if self.key not in ARGUMENT_KEYS or self.arguments_key is not None:
            return False
        return self.value_kind == "container"

    def _value_char(self, ch: str) -> None:
        kind = self.value_kind
        if kind == "scalar":
            if ch in WHITESPACE or ch in ",}":
                self._end_value()
                self.push(ch)  # the character after a number or literal is structure
                return
            self.raw.append(ch)
            return
        self.raw.append(ch)
        if self._streams_arguments():
            self.arguments_out.append(ch)
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if kind == "string":
                    self._end_value()
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                self._end_value()

    def _end_value(self) -> None:
        self.state = _AFTER_VALUE
        raw = "".join(self.raw)
        if self.key == "name" and self.name is None:
            name = _decode_string(raw[1:-1]) if self.value_kind == "string" else None
            if not name:
                self.failed = True
                return
            self.name = name
        elif self.key in ARGUMENT_KEYS and self.arguments_key is None:
            if self.value_kind == "string":  # arguments sent as a JSON string of JSON
                self.arguments_out.append(_decode_string(raw[1:-1]) or "")
            elif self.value_kind != "container":
                self.arguments_out.append(raw)
            self.arguments_key = self.key

    def _close(self) -> None:
        if self.arguments_key is None:  # a function without parameters
            self.arguments_out.append("{}")
        self.done = True


def _decode_string(body: str) -> str | None:
    try:
        return json.loads(f'"{body}"')
    except json.JSONDecodeError:
        return None
