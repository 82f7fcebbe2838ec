"""Incremental detokenization: token-by-token text equals whole decoding; stop strings."""

import pytest

from common.tokenizer import load_tokenizer
from scheduler_svc.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello wörld 你好 🎉! Ünïcödé, emoji 👩‍👩‍👧 and   spaces.",
    "def f(x):\n    return x ** 2  # squares\n",
    "naïve café — “quotes” and ‘single’ ones…",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def stream(tok, prompt_ids, ids, stop=(), chunk=1):
    detok = IncrementalDetokenizer.for_prompt(tok, prompt_ids, True, list(stop))
    pieces = []
    for i in range(0, len(ids), chunk):
        detok.add_tokens(ids[i : i + chunk])
        last = i + chunk >= len(ids)
        pieces.append(detok.take_delta(final=last or detok.stop_hit is not None))
        if detok.stop_hit is not None:
            break
    return pieces, detok


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_equals_full_decode(tok, text, chunk):
    prompt = tok.encode("Say something:")
    ids = tok.encode(text)
    pieces, _ = stream(tok, prompt, ids, chunk=chunk)
    assert "".join(pieces) == tok.decode(ids)
    # no piece ends inside a multi-byte character
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_truncates_and_is_held_back(tok):
    ids = tok.encode("The answer is 42. END of story")
    pieces, detok = stream(tok, [], ids, stop=["END"])
    assert detok.stop_hit == "END"
    assert "".join(pieces) == "The answer is 42. "
    # nothing after the stop string was ever emitted
    assert all("END" not in p and "story" not in p for p in pieces)


def test_partial_stop_prefix_is_released_when_not_a_stop(tok):
    ids = tok.encode("an EN dash, then more")
    pieces, detok = stream(tok, [], ids, stop=["END"])
    assert detok.stop_hit is None
    assert "".join(pieces) == tok.decode(ids)


def test_stop_string_spanning_tokens(tok):
    text = "alpha beta<|sep|>gamma"
    ids = tok.encode(text)
    pieces, detok = stream(tok, [], ids, stop=["a<|sep"])
    assert detok.stop_hit == "a<|sep"
    assert "".join(pieces) == "alpha bet"
