"""Structured output: a StructuredOutput (common/messages.py) as an llguidance grammar.

llguidance compiles every kind (JSON schema, any JSON object, regex, choice, Lark/GBNF) in a
few milliseconds and needs no torch, so the front-end refuses an invalid constraint before it is
queued and the worker builds one matcher per constrained request from the same grammar text
(docs/structured_output.md has the measurements behind the choice).
"""

from __future__ import annotations

import json
import re
from typing import Any

from common.messages import StructuredOutput

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 256


# Whitespace between JSON tokens: enough for compact, spaced and indented layouts, but bounded.
# Unbounded (the engine's default), a sampled small model can emit whitespace until its tokens
# run out and never close the document.
JSON_LAYOUT = {"whitespace_pattern": r"[\n\t ]{0,20}"}


class InvalidConstraint(ValueError):
    """The constraint cannot be compiled; the message says why."""


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
