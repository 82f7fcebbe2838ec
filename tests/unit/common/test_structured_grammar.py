"""common/structured.py's grammars: constrained JSON is compact (one layout, no free whitespace,
so a sampled model cannot pad a document until its tokens run out) unless the schema opts out,
and `any_of` accepts exactly one of its options, framed and repeated as asked."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from common import structured
from common.messages import StructuredOutput
from common.structured import InvalidConstraint, Option, any_of
from common.tokenizer import load_tokenizer

TOK = load_tokenizer(None)
LL = structured.ll_tokenizer(TOK, TOK.eos_token_id)
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "integer"}}},
    "required": ["a"],
}
CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"$ref": "#/$defs/City"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
    "$defs": {"City": {"type": "string", "enum": ["Paris", "Rome"]}},
}
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
    "additionalProperties": False,
}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def accepts(constraint: StructuredOutput, text: str) -> bool:
    """`text`, tokenized as the model would write it, is a whole output the constraint allows."""
    matcher = LLMatcher(LL, structured.check(constraint, LL), log_level=0)
    ids = TOK.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def tools_or_answer(times: int = 4) -> StructuredOutput:
    call = StructuredOutput("json_schema", json.dumps(CALL))
    tagged = Option(call, "<tool_call>\n", "\n</tool_call>", times, between="\n")
    return any_of([tagged, Option(StructuredOutput("json_schema", json.dumps(ANSWER)))])


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutput("json_schema", json.dumps(SCHEMA)),
        StructuredOutput("json_object"),
        any_of([Option(StructuredOutput("json_schema", json.dumps(SCHEMA)))]),
    ],
    ids=["json_schema", "json_object", "any_of"],
)
def test_json_is_compact_with_one_space_after_colons_and_commas(constraint):
    assert accepts(constraint, '{"a": 1, "b": [1, 2]}')
    for text in (
        '{"a":1,"b":[1,2]}',  # no spaces
        '{"a": 1,"b": [1, 2]}',  # mixed
        '{ "a": 1 }',
        '{"a":  1}',
        '{\n  "a": 1,\n  "b": [\n    1,\n    2\n  ]\n}',  # indented
        '{"a": 1}\n',
    ):
        assert not accepts(constraint, text), text


def test_a_schema_can_opt_into_bounded_free_whitespace_with_its_own_layout_options():
    layout = {
        "whitespace_flexible": True,
        "item_separator": ",",
        "key_separator": ":",
        "whitespace_pattern": "[\\n ]{0,4}",
    }
    spec = json.dumps({**SCHEMA, "x-guidance": layout})
    opted = StructuredOutput("json_schema", spec)
    assert accepts(opted, '{\n  "a": 1,\n  "b": [1,2]\n}')
    assert accepts(opted, '{"a":1}')
    assert not accepts(opted, '{"a":' + " " * 5 + "1}")


def test_any_of_accepts_a_tagged_call_or_an_answer_in_the_format_and_nothing_else():
    union = tools_or_answer()
    assert accepts(union, CALL_TEXT)
    assert accepts(union, '{"answer": "sunny"}')
    assert accepts(union, "\n".join([CALL_TEXT] * 4))
    for text in (
        "It is sunny.",  # free text
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',  # a call without its tags
        CALL_TEXT.replace("Paris", "Oslo"),  # arguments outside the tool's schema
        CALL_TEXT.replace("get_weather", "launch"),  # not a tool
        '<tool_call>\n{"answer": "sunny"}\n</tool_call>',  # an answer in a call's tags
        CALL_TEXT + '\n{"answer": "sunny"}',  # a call, then an answer
        '{"answer": "sunny"}\n' + CALL_TEXT,
        "Let me check.\n" + CALL_TEXT,
        "\n".join([CALL_TEXT] * 5),  # more calls than `times`
        '{"answer": 3}',
    ):
        assert not accepts(union, text), text
    assert not accepts(tools_or_answer(times=1), "\n".join([CALL_TEXT] * 2))


def test_any_of_options_of_every_kind_each_in_its_frame():
    union = any_of(
        [
            Option(StructuredOutput("regex", "[0-9]{2}"), before="n=", after="!"),
            Option(StructuredOutput("choice", json.dumps(["yes", "no"]))),
            Option(StructuredOutput("grammar", 'start: "x" "y"*'), times=3, between=","),
            Option(StructuredOutput("json_object")),
        ]
    )
    for text in ("n=42!", "yes", "no", "xyy", "xy,x,xyyy", "{}"):
        assert accepts(union, text), text
    for text in ("n=42", "42!", "n=4!", "maybe", "xy,x,x,x", "xy,", "yes{}"):
        assert not accepts(union, text), text


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("[]", "1 to"),
        ("{}", "JSON list"),
        ('[{"kind": "regex"}]', "needs"),
        ('[{"constraint": {"kind": "any_of", "spec": "[]"}}]', "nest"),
        ('[{"constraint": {"kind": "regex", "spec": "a"}, "times": 0}]', "times"),
        ('[{"constraint": {"kind": "regex", "spec": "a"}, "times": 99}]', "times"),
        ('[{"constraint": {"kind": "regex", "spec": "a"}, "before": 1}]', "strings"),
        ('[{"constraint": {"kind": "json_schema", "spec": "{"}}]', "not valid JSON"),
        ('[{"constraint": {"kind": "sql", "spec": ""}}]', "unknown"),
    ],
)
def test_a_malformed_any_of_is_refused_with_the_reason(spec, needle):
    with pytest.raises(InvalidConstraint) as err:
        structured.check(StructuredOutput("any_of", spec), LL)
    assert needle in str(err.value)
