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


@pytest.mark.parametrize("stop", [(), ("STOPHERE", "xy")])
def test_long_output_keeps_only_a_short_tail(tok, stop):
    """Handed-out text is dropped (but what a stop string could begin with), so each token
    costs the same however long the output is; the text and the stop string still come out
    exactly."""
    body = TEXTS[0] * 40
    ids = tok.encode(body + " STOPHERE and after")
    detok = IncrementalDetokenizer.for_prompt(tok, [], True, list(stop))
    pieces, longest = [], 0
    for tid in ids:
        detok.add_tokens([tid])
        pieces.append(detok.take_delta(final=detok.stop_hit is not None))
        longest = max(longest, len(detok.text))
        if detok.stop_hit is not None:
            break
    if stop:
        assert detok.stop_hit == "STOPHERE"
        assert "".join(pieces) == body + " "
    else:
        pieces.append(detok.take_delta(final=True))
        assert "".join(pieces) == tok.decode(ids)
    assert longest < 40  # never the whole text (thousands of characters)


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stop_string_across_dropped_text(tok, chunk):
    text = "ab" * 200 + "THE END" + "zz"
    ids = tok.encode(text)
    pieces, detok = stream(tok, [], ids, stop=["THE END", "b" * 9], chunk=chunk)
    assert detok.stop_hit == "THE END"
    assert "".join(pieces) == "ab" * 200


@pytest.mark.parametrize("stop", [(), ("ones",), ("’",)])
@pytest.mark.parametrize("chunk", [1, 2])
def test_push_equals_add_then_take(tok, stop, chunk):
    prompt = tok.encode("Say something:")
    for text in TEXTS:
        ids = tok.encode(text)
        expected, ref = stream(tok, prompt, ids, stop=stop, chunk=chunk)
        detok = IncrementalDetokenizer.for_prompt(tok, prompt, True, list(stop))
        got = []
        for i in range(0, len(ids), chunk):
            got.append(detok.push(ids[i : i + chunk], i + chunk >= len(ids)))
            if detok.stop_hit is not None:
                break
        assert got == expected and detok.stop_hit == ref.stop_hit
