"""common/structured.py's grammars: JSON layouts a model may write are allowed, whitespace is
bounded (so a sampled model cannot pad a document until its tokens run out)."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from common import structured
from common.messages import StructuredOutput
from common.tokenizer import load_tokenizer

TOK = load_tokenizer(None)
LL = structured.ll_tokenizer(TOK, TOK.eos_token_id)
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "integer"}}},
    "required": ["a"],
}


def accepts(kind: str, spec: str, text: str) -> bool:
    matcher = LLMatcher(LL, structured.grammar(StructuredOutput(kind, spec)), log_level=0)
    ids = TOK.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


@pytest.mark.parametrize("kind,spec", [("json_schema", json.dumps(SCHEMA)), ("json_object", "")])
def test_json_layouts_are_allowed_and_whitespace_is_bounded(kind, spec):
    for text in (
        '{"a":1,"b":[1,2]}',
        '{"a": 1, "b": [1, 2]}',
        '{\n  "a": 1,\n  "b": [\n    1,\n    2\n  ]\n}',
        '{"a":' + " " * 20 + "1}",
    ):
        assert accepts(kind, spec, text), text
    assert not accepts(kind, spec, '{"a":' + " " * 21 + "1}")
    assert not accepts(kind, spec, "{" + "\n" * 40 + '"a": 1}')
