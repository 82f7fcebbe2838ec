"""http/tool_parser.py: content and tool calls read out of a chat output, whole or in pieces."""

from __future__ import annotations

import json
import random

import pytest

from frontend_svc.http.tool_parser import (
    NamedCallParser,
    ParsedDelta,
    ToolCallParser,
    assemble,
)

NAMES = ("get_weather", "get_time")
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def parse(text: str, cuts: list[int] = (), parser=None) -> tuple[str, list[tuple[str, str]]]:
    """Feed `text` cut at `cuts`; the content and (name, arguments) of each call."""
    parser = parser or ToolCallParser(NAMES)
    total = ParsedDelta()
    bounds = [0, *sorted(cuts), len(text)]
    for start, end in zip(bounds, bounds[1:], strict=False):
        total.extend(parser.feed(text[start:end]))
    total.extend(parser.finish())
    content, calls = assemble(total)
    return content, [(c.name, c.arguments) for c in calls]


OUTPUTS = {
    # output: (content, calls)
    "Paris is sunny.": ("Paris is sunny.", []),
    "  an answer with spaces \n": ("  an answer with spaces \n", []),
    f"<tool_call>\n{WEATHER}\n</tool_call>": ("", [("get_weather", '{"city": "Paris"}')]),
    f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n"
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nDone.': (
        "Let me look.\nDone.",
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    ),
    WEATHER: ("", [("get_weather", '{"city": "Paris"}')]),
    f"\n {WEATHER} \n": ("", [("get_weather", '{"city": "Paris"}')]),
    '{"name": "launch", "arguments": {}}': ('{"name": "launch", "arguments": {}}', []),
    '{"city": "Paris"}': ('{"city": "Paris"}', []),
    '[{"name": "get_weather", "arguments": {"city": "P]}\\"aris"}}, '
    '{"name": "get_time", "parameters": {"zones": [1, {"x": "}"}]}}]': (
        "",
        [("get_weather", '{"city": "P]}\\"aris"}'), ("get_time", '{"zones": [1, {"x": "}"}]}')],
    ),
    "[1, 2]": ("[1, 2]", []),
    "[]": ("[]", []),
    '<tool_call>{"arguments": {"a": 1}, "name": "get_time"}</tool_call>': (
        "",
        [("get_time", '{"a": 1}')],
    ),
    '<tool_call>{"name": "get_time", "arguments": "{\\"a\\": 1}"}</tool_call>': (
        "",
        [("get_time", '{"a": 1}')],
    ),
    '<tool_call>{"name": "get_time", "n": -1.5e3, "ok": true}</tool_call>': (
        "",
        [("get_time", "{}")],
    ),
    "<tool_call>not json</tool_call> fine": ("<tool_call>not json</tool_call> fine", []),
    '<tool_call>{"name": "get_time", "arguments": {"a": 1}, oops}</tool_call> after': (
        "after",
        [("get_time", '{"a": 1}')],
    ),
    "a < b and <tool": ("a < b and <tool", []),
    # truncated outputs (finish_reason length)
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Par': (
        "",
        [("get_weather", '{"city": "Par')],
    ),
    '<tool_call>{"nam': ('<tool_call>{"nam', []),
    '[{"name": "get_time", "arguments": {}}, {"na': ("", [("get_time", "{}")]),
}


@pytest.mark.parametrize("text", list(OUTPUTS), ids=range(len(OUTPUTS)))
def test_output_gives_its_content_and_calls_whole_or_cut_anywhere(text):
    expected = OUTPUTS[text]
    assert parse(text) == expected
    for cut in range(1, len(text)):
        assert parse(text, [cut]) == expected, cut
    assert parse(text, list(range(1, len(text)))) == expected
    rng = random.Random(len(text))
    for _ in range(20):
        assert parse(text, rng.sample(range(1, len(text)), min(3, len(text) - 1))) == expected


def test_a_call_streams_its_id_and_name_once_then_argument_fragments():
    parser = ToolCallParser(NAMES)
    first = parser.feed('<tool_call>{"name": "get_weather", "arguments": {"ci')
    assert first.content == ""
    (start,) = first.calls
    assert start.index == 0 and start.name == "get_weather" and start.id.startswith("call_")
    assert start.arguments == '{"ci'
    more = parser.feed('ty": "Paris"}}</tool_call>')
    assert [(c.index, c.id, c.name, c.arguments) for c in more.calls] == [
        (0, None, None, 'ty": "Paris"}')
    ]
    assert parser.finish().calls == [] and parser.called


def test_text_that_may_start_a_tag_is_held_until_decided():
    parser = ToolCallParser(NAMES)
    assert parser.feed("Sure <tool").content == "Sure"
    assert parser.feed("box> here").content == " <toolbox> here"
    assert parser.finish().content == ""


def test_whitespace_around_calls_is_not_content():
    parser = ToolCallParser(NAMES)
    assert parser.feed("\n\n").content == ""
    step = parser.feed(f"<tool_call>{WEATHER}</tool_call>\n")
    assert step.content == "" and step.calls
    assert parser.finish().content == ""


def test_without_parallel_calls_only_the_first_is_kept():
    text = f"<tool_call>{WEATHER}</tool_call><tool_call>{WEATHER}</tool_call>"
    assert parse(text, parser=ToolCallParser(NAMES, parallel=False)) == (
        "",
        [("get_weather", '{"city": "Paris"}')],
    )


def test_call_ids_differ():
    ids = set()
    for _ in range(3):
        parser = ToolCallParser(NAMES)
        total = parser.feed(f"<tool_call>{WEATHER}</tool_call>" * 2)
        ids.update(c.id for c in total.calls if c.id)
    assert len(ids) == 6


def test_a_named_choice_makes_the_whole_output_its_arguments():
    args = '{"city": "Paris", "days": [1, 2]}'
    for cut in range(len(args)):
        assert parse(args, [cut] if cut else [], NamedCallParser("get_weather")) == (
            "",
            [("get_weather", args)],
        )
    assert json.loads(parse(args, parser=NamedCallParser("get_weather"))[1][0][1])["days"]
    assert parse("", parser=NamedCallParser("get_weather")) == ("", [])
