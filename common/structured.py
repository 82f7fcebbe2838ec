"""Structured output: a StructuredOutput (common/messages.py) as an llguidance grammar.

llguidance compiles every kind (JSON schema, any JSON object, regex, choice, Lark/GBNF) in a
few milliseconds and needs no torch, so the front-end refuses an invalid constraint before it is
queued and the worker builds one matcher per constrained request from the same grammar text
(docs/structured_output.md has the measurements behind the choice).

`any_of` is the alternation of the others: the output matches exactly one of its options, each
optionally framed by literal text and repeated (a tool call in `<tool_call>` tags, or an answer
in the body's format: docs/tools.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from common.messages import StructuredOutput

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "any_of")
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 256
MAX_OPTIONS = 16
MAX_TIMES = 16

# JSON as json.dumps writes it by default: ", " between items, ": " after a key, no other
# whitespace (no newlines, no indentation). One layout, so no token goes to whitespace and a
# sampled model cannot pad a document until its tokens run out. A schema's own "x-guidance"
# options override these key by key (llguidance's opt-in): {"whitespace_flexible": true,
# "item_separator": ",", "key_separator": ":", "whitespace_pattern": "[\\n\\t ]{0,20}"} is
# the earlier layout, any indentation with at most 20 whitespace characters in a row.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class InvalidConstraint(ValueError):
    """The constraint cannot be compiled; the message says why."""


@dataclass(slots=True, frozen=True)
class Option:
    """One alternative of an `any_of`: `constraint` framed as `before` + it + `after`, written
    1 to `times` times with `between` after each but the last."""

    constraint: StructuredOutput
    before: str = ""
    after: str = ""
    times: int = 1
    between: str = ""


def any_of(options: Sequence[Option]) -> StructuredOutput:
    """The constraint whose output matches exactly one of `options`."""
    spec = [asdict(option) for option in options]  # the constraint as {"kind", "spec"}
    return StructuredOutput("any_of", json.dumps(spec, ensure_ascii=False))


def grammar(structured: StructuredOutput) -> str:
    """The llguidance grammar text of a constraint (not yet checked: see `check`)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

    kind, spec = structured.kind, structured.spec
    if kind not in KINDS:
        raise InvalidConstraint(f"unknown structured output kind {kind!r}; use one of {KINDS}")
    if len(spec) > MAX_SPEC_CHARS:
        raise InvalidConstraint(f"the {kind} is longer than {MAX_SPEC_CHARS} characters")
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise InvalidConstraint(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise InvalidConstraint("the JSON schema must be a JSON object")
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = _choices(spec)
        return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in choices))
    if kind == "any_of":
        return _any_of_grammar(_options(spec))
    try:
        lark = gbnf_to_lark(spec) if "::=" in spec else spec
    except GbnfToLarkError as exc:
        raise InvalidConstraint(f"the grammar is not valid GBNF: {exc}") from None
    return LLMatcher.grammar_from_lark(lark)


def _choices(spec: str) -> list[str]:
    try:
        choices: Any = json.loads(spec)
    except json.JSONDecodeError:
        choices = None
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise InvalidConstraint("choice needs a JSON list of strings")
    if not choices or len(choices) > MAX_CHOICES or not all(choices):
        raise InvalidConstraint(f"choice needs 1 to {MAX_CHOICES} non-empty strings")
    return choices


# ---- any_of ----------------------------------------------------------------------------------
def _options(spec: str) -> list[Option]:
    try:
        raw: Any = json.loads(spec)
    except json.JSONDecodeError:
        raw = None
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_OPTIONS:
        raise InvalidConstraint(f"any_of needs a JSON list of 1 to {MAX_OPTIONS} options")
    return [_option(i, item) for i, item in enumerate(raw)]


def _option(i: int, item: Any) -> Option:
    inner = item.get("constraint") if isinstance(item, dict) else None
    kind = inner.get("kind") if isinstance(inner, dict) else None
    if not isinstance(kind, str) or not isinstance(inner.get("spec", ""), str):
        raise InvalidConstraint(f'any_of option {i} needs {{"constraint": {{"kind", "spec"}}}}')
    if kind == "any_of":
        raise InvalidConstraint(f"any_of option {i}: an any_of cannot nest another")
    texts = {key: item.get(key, "") for key in ("before", "after", "between")}
    times = item.get("times", 1)
    if not all(isinstance(t, str) for t in texts.values()):
        raise InvalidConstraint(f"any_of option {i}: before, after and between are strings")
    if not isinstance(times, int) or not 1 <= times <= MAX_TIMES:
        raise InvalidConstraint(f"any_of option {i}: times must be 1 to {MAX_TIMES}")
    return Option(StructuredOutput(kind, inner.get("spec", "")), times=times, **texts)


def _any_of_grammar(options: list[Option]) -> str:
    """A Lark grammar whose start is one rule per option. A JSON option's schema is inlined
    (`%json`, its layout options included); any other is a side grammar it references."""
    from llguidance import LLMatcher

    side: list[dict[str, Any]] = []
    rules = ["start: " + " | ".join(f"option_{i}" for i in range(len(options)))]
    for i, option in enumerate(options):
        body = _embedded(grammar(option.constraint), f"option_{i}_grammar", side)
        item = " ".join(t for t in (_literal(option.before), body, _literal(option.after)) if t)
        repeat = ""
        if option.times > 1:
            again = " ".join(t for t in (_literal(option.between), f"item_{i}") if t)
            repeat = f" ({again}){{0,{option.times - 1}}}"
        rules += [f"option_{i}: item_{i}{repeat}", f"item_{i}: {item}"]
    lark = "\n".join(rules) + "\n"
    if not side:
        return LLMatcher.grammar_from_lark(lark)
    return json.dumps({"grammars": [{"name": "any_of", "lark_grammar": lark}, *side]})


def _embedded(text: str, name: str, side: list[dict[str, Any]]) -> str:
    """One compiled grammar as a Lark expression: `%json {...}` or `@name` of a side grammar."""
    try:
        top = json.loads(text)
    except json.JSONDecodeError:  # grammar_from_lark returns the Lark text itself
        top = {"grammars": [{"lark_grammar": text}]}
    (one,) = top["grammars"]  # one per kind (an any_of does not nest)
    if one.get("json_schema") is not None:
        return "%json " + json.dumps(one["json_schema"], ensure_ascii=False)
    side.append({"name": name, "lark_grammar": one["lark_grammar"]})
    return "@" + name


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False) if text else ""


# ---- checking, and the tokenizer ------------------------------------------------------------
def check(structured: StructuredOutput, tokenizer=None) -> str:
    """Compile and validate; returns the grammar text, raises InvalidConstraint."""
    from llguidance import LLMatcher

    text = grammar(structured)
    problem = LLMatcher.validate_grammar(text, tokenizer)
    if problem:
        raise InvalidConstraint(f"the {structured.kind} is not valid: {problem}")
    return text


def ll_tokenizer(tokenizer, eos_token_id: int | None):
    """The llguidance view of one of common/tokenizer.py's tokenizers (its `backend`, a
    tokenizers.Tokenizer), built once per process."""
    from llguidance import LLTokenizer

    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        raise InvalidConstraint("structured output needs a tokenizers-backed tokenizer")
    return LLTokenizer(backend.to_str(), eos_token=eos_token_id)
