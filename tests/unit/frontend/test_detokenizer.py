"""Incremental detokenization: token-by-token text equals whole decoding; stop strings. Every
test runs on the three ways of turning tokens into text: the byte table of byte-level BPE
tokenizers, the tokenizers library's DecodeStream, and re-decoding a short window."""

import random

import pytest
import tokenizers

from common.byte_pieces import build_byte_pieces, complete_utf8_prefix
from common.tokenizer import load_tokenizer
from frontend_svc.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello wörld 你好 🎉! Ünïcödé, emoji 👩‍👩‍👧 and   spaces.",
    "def f(x):\n    return x ** 2  # squares\n",
    "naïve café — “quotes” and ‘single’ ones…",
]


class WithoutTable:
    """The real tokenizer minus its byte table (and minus the backend for the window path)."""

    def __init__(self, tokenizer, keep_backend: bool) -> None:
        self._tokenizer = tokenizer
        if keep_backend:
            self.backend = tokenizer.backend

    def encode(self, text):
        return self._tokenizer.encode(text)

    def decode(self, ids, skip_special_tokens=True):
        return self._tokenizer.decode(ids, skip_special_tokens)


@pytest.fixture(scope="module")
def real_tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module", params=["byte_table", "decode_stream", "window"])
def tok(request, real_tok):
    if request.param == "byte_table":
        assert real_tok.byte_pieces() is not None
        return real_tok
    return WithoutTable(real_tok, keep_backend=request.param == "decode_stream")


def test_detokenizer_picks_the_byte_table_for_byte_level_bpe(real_tok):
    detok = IncrementalDetokenizer.for_prompt(real_tok, [1, 2], True, [])
    assert detok.pieces is not None and detok.stream is None
    detok = IncrementalDetokenizer.for_prompt(WithoutTable(real_tok, True), [1, 2], True, [])
    assert detok.pieces is None and detok.stream is not None


def test_byte_table_equals_the_tokenizer_on_random_sequences(real_tok):
    """Random ids (special tokens and lone partial characters included), pushed in random
    chunks: the text so far always equals decoding all ids (replacement characters for invalid
    bytes included), but for a started character held back, which is dropped if the output ends
    inside it, as on the other paths."""
    rng = random.Random(7)
    table = real_tok.byte_pieces()
    partial = [i for i, t in enumerate(table.texts) if t is None]
    assert len(partial) > 100  # byte tokens that are pieces of multi-byte characters
    for skip in (True, False):
        for _ in range(60):
            ids = [
                rng.choice(partial) if rng.random() < 0.3 else rng.randrange(real_tok.vocab_size)
                for _ in range(rng.randrange(1, 40))
            ]
            detok = IncrementalDetokenizer.for_prompt(real_tok, [], skip, [])
            text, i = "", 0
            while i < len(ids):
                n = rng.randrange(1, 4)
                text += detok.push(ids[i : i + n], final=i + n >= len(ids))
                i += n
                full = real_tok.decode(ids[:i], skip)
                assert full.startswith(text) and set(full[len(text) :]) <= {"\ufffd"}
            data = b"".join(table.tables(skip)[0][t] for t in ids)
            if complete_utf8_prefix(data) == len(data):
                assert text == real_tok.decode(ids, skip)


def test_a_character_split_over_tokens_waits_for_its_last_byte(real_tok):
    table = real_tok.byte_pieces()
    by_bytes = {p: i for i, p in enumerate(table.pieces)}
    emoji = "🎉".encode()
    if not all(bytes([b]) in by_bytes for b in emoji):
        pytest.skip("the vocabulary has no single-byte tokens for this character")
    ids = [by_bytes[bytes([b])] for b in emoji]
    detok = IncrementalDetokenizer.for_prompt(real_tok, [], True, [])
    assert [detok.push([t], final=False) for t in ids] == ["", "", "", "🎉"]
    detok = IncrementalDetokenizer.for_prompt(real_tok, [], True, [])
    assert detok.push([ids[0]], final=False) == ""
    assert detok.push([ids[1]], final=True) == ""  # never completed: dropped, not U+FFFD


def test_complete_utf8_prefix():
    for text in ("a", "é", "你", "🎉", "a你🎉"):
        data = text.encode()
        assert complete_utf8_prefix(data) == len(data)
        for cut in range(1, len(text[-1].encode())):
            assert complete_utf8_prefix(data[:-cut]) == len(data) - len(text[-1].encode())
    assert complete_utf8_prefix(b"") == 0
    # stray continuation bytes wait (shown as U+FFFD only once text follows them)
    assert complete_utf8_prefix(b"a\x80\x80") == 1
    assert complete_utf8_prefix("é".encode() + b"\x80") == 2
    assert complete_utf8_prefix(b"\x80" * 5) == 1


def test_no_byte_table_for_other_decoders():
    vocab = {"[UNK]": 0, "hello": 1, "##lo": 2}
    backend = tokenizers.Tokenizer(tokenizers.models.WordPiece(vocab, unk_token="[UNK]"))
    backend.decoder = tokenizers.decoders.WordPiece()
    assert build_byte_pieces(backend) is None


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
