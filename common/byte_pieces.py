"""Token id -> bytes for byte-level BPE tokenizers (SmolLM2, Llama 3, Qwen 2, GPT-2), so the
scheduler's step loop turns a sampled token into text with a list lookup instead of a call into
the tokenizer (one per request per step: at thousands of running requests, the largest single
cost of a step after the asyncio wake-ups).

Byte-level BPE spells every byte as one printable character; a token's bytes are its characters
mapped back, and decoding a sequence is the UTF-8 decoding of its tokens' bytes joined. The table
is only trusted after it reproduces the tokenizer's own decode of every token; any tokenizer it
does not reproduce (a SentencePiece-style decoder, normalizers that change text on decode) keeps
the tokenizer's own incremental decoder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import tokenizers

_SAMPLE_TEXTS = (
    "Hello, world! The quick brown fox jumps over the lazy dog.\n\tIndented    spaces",
    "多字节字符：你好，世界。日本語のテキスト、한국어 텍스트",
    "emoji 🙂🚀👩‍👩‍👧 and accents: café naïve Ελληνικά русский",
    "code: def f(x):\n    return {'a': [1, 2, 3]}  # comment\r\n",
)


def _byte_alphabet() -> dict[str, int]:
    """The printable character that stands for each byte: bytes that print as themselves in
    Latin-1 keep their code point, the other 68 are numbered from 256 upwards in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    alphabet = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in alphabet.values():
            alphabet[chr(256 + shifted)] = b
            shifted += 1
    return alphabet


@dataclass(slots=True, frozen=True)
class BytePieces:
    """Per token id: its bytes, and its text when those bytes are complete UTF-8 on their own
    (None otherwise); one table with special tokens as their text, one with them empty."""

    pieces: tuple[bytes, ...]
    texts: tuple[str | None, ...]
    pieces_skip_special: tuple[bytes, ...]
    texts_skip_special: tuple[str | None, ...]

    def tables(self, skip_special_tokens: bool) -> tuple[tuple[bytes, ...], tuple[str | None, ...]]:
        if skip_special_tokens:
            return self.pieces_skip_special, self.texts_skip_special
        return self.pieces, self.texts


def build_byte_pieces(backend: tokenizers.Tokenizer) -> BytePieces | None:
    """The byte table of `backend`, or None when its decoding is not plain byte-level BPE."""
    config = json.loads(backend.to_str())
    decoder = config.get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        return None
    alphabet = _byte_alphabet()
    added = backend.get_added_tokens_decoder()
    size = backend.get_vocab_size(with_added_tokens=True)
    pieces: list[bytes] = []
    special: set[int] = set()
    for token_id in range(size):
        token = backend.id_to_token(token_id)
        if token is None:
            pieces.append(b"")
        elif token_id in added:
            pieces.append(added[token_id].content.encode())
            if added[token_id].special:
                special.add(token_id)
        elif all(ch in alphabet for ch in token):
            pieces.append(bytes(alphabet[ch] for ch in token))
        else:
            return None
    texts = tuple(_text_or_none(p) for p in pieces)
    skip_pieces = tuple(b"" if i in special else p for i, p in enumerate(pieces))
    skip_texts = tuple("" if i in special else t for i, t in enumerate(texts))
    table = BytePieces(tuple(pieces), texts, skip_pieces, skip_texts)
    return table if _reproduces(backend, table) else None


def _text_or_none(piece: bytes) -> str | None:
    try:
        return piece.decode()
    except UnicodeDecodeError:
        return None


def _reproduces(backend: tokenizers.Tokenizer, table: BytePieces) -> bool:
    """Every token alone, both ways of treating special tokens, and a few multilingual texts
    token by token, decode as the tokenizer decodes them."""
    for skip in (False, True):
        pieces, texts = table.tables(skip)
        for token_id, text in enumerate(texts):
            expected = backend.decode([token_id], skip_special_tokens=skip)
            if text is None:
                if "\ufffd" not in expected:  # a partial character decodes to a replacement
                    return False
            elif text != expected:
                return False
        for sample in _SAMPLE_TEXTS:
            ids = backend.encode(sample, add_special_tokens=False).ids
            joined = b"".join(pieces[i] for i in ids).decode("utf-8", "replace")
            if joined != backend.decode(ids, skip_special_tokens=skip):
                return False
    return True


def complete_utf8_prefix(data: bytes) -> int:
    """Length of `data` less its unfinished tail: the bytes of a character still being generated
    wait for the rest, and so do stray continuation bytes at the end (up to four; decoded, as
    U+FFFD, only once more text follows them: what decoding token by token shows)."""
    n = len(data)
    trailing = 0  # continuation bytes at the end
    for back in range(1, min(4, n) + 1):
        byte = data[n - back]
        if 0x80 <= byte < 0xC0:
            trailing += 1
        elif byte >= 0xC0:  # a lead byte and its continuation bytes
            needed = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            if back < needed:
                return n - back
            return n - (back - needed)  # continuation bytes beyond the character: stray
        else:
            return n - trailing
    return n - trailing
