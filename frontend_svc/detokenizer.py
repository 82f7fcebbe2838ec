"""Incremental, UTF-8-safe detokenization with stop strings held back until they cannot match.

Decoding token by token breaks multi-byte characters and merges (a space that belongs to the
next word, a character split over two byte tokens). We decode a short window twice: the text up
to the last emitted token, and the text including the new tokens; the difference is new text,
unless it ends in U+FFFD (an incomplete character), in which case we wait for more tokens.
Byte-level BPE tokenizers (the usual case) skip all that: a token is a few bytes from a table
(common/byte_pieces.py) and only a character split over tokens waits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from common.byte_pieces import complete_utf8_prefix

try:  # the Rust incremental decoder (tokenizers >= 0.21): one call per step, no re-decoding
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover
    DecodeStream = None

# tokens kept before the unread ones so merges (leading spaces) decode right
_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(slots=True)
class IncrementalDetokenizer:
    decoder: Decoder
    skip_special_tokens: bool = True
    stop_strings: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # decoded text not handed out yet, after the last `emitted` characters that were (at most
    # the longest stop string less one: what a stop string beginning before the new text needs);
    # older text is dropped so a long output never costs a copy of itself per token
    text: str = ""
    emitted: int = 0  # characters at the start of `text` already handed out
    keep: int = 0  # handed-out characters kept (longest stop string - 1)
    prefix_offset: int = 0
    read_offset: int = 0
    stop_hit: str | None = None
    include_stop: bool = False  # a matched stop string stays in the text (vLLM's option)
    stream: Any = None  # a DecodeStream when the decoder is a tokenizers-backed Tokenizer
    # byte-level BPE: token id -> bytes / -> text when complete alone (common/byte_pieces.py)
    pieces: tuple[bytes, ...] | None = None
    texts: tuple[str | None, ...] = ()
    pending: bytes = b""  # the started character's bytes, waiting for the rest

    @classmethod
    def for_prompt(
        cls,
        decoder: Decoder,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        stop_strings: list[str],
        include_stop: bool = False,
    ) -> IncrementalDetokenizer:
        stops = [s for s in stop_strings if s]
        keep = max((len(s) for s in stops), default=1) - 1
        byte_pieces = getattr(decoder, "byte_pieces", None)
        table = byte_pieces() if byte_pieces is not None else None
        if table is not None:
            pieces, texts = table.tables(skip_special_tokens)
            return cls(
                decoder,
                skip_special_tokens,
                stops,
                include_stop=include_stop,
                pieces=pieces,
                texts=texts,
                keep=keep,
            )
        tail = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        backend = getattr(decoder, "backend", None)
        stream = None
        if backend is not None and DecodeStream is not None:
            stream = DecodeStream(ids=tail, skip_special_tokens=skip_special_tokens)
        return cls(
            decoder=decoder,
            skip_special_tokens=skip_special_tokens,
            stop_strings=stops,
            token_ids=[] if stream is not None else tail,
            prefix_offset=0,
            read_offset=0 if stream is not None else len(tail),
            stream=stream,
            keep=keep,
            include_stop=include_stop,
        )

    def push(self, new_token_ids: list[int], final: bool) -> str:
        """add_tokens, then take_delta (final as well once a stop string is hit): the new
        text safe to show. A table lookup (byte-level BPE) or one Rust call for the usual case
        (no stop strings)."""
        if self.pieces is not None and not self.stop_strings:
            if len(new_token_ids) == 1 and not self.pending:
                token_id = new_token_ids[0]
                texts = self.texts
                if 0 <= token_id < len(texts):
                    text = texts[token_id]
                    if text is not None:
                        return text
            return self._bytes_to_text(new_token_ids)
        stream = self.stream
        if stream is not None and not self.stop_strings and not self.text:
            if not new_token_ids:
                return ""
            piece = stream.step(
                self.decoder.backend,
                new_token_ids[0] if len(new_token_ids) == 1 else list(new_token_ids),
            )
            return piece or ""
        self.add_tokens(new_token_ids)
        return self.take_delta(final or self.stop_hit is not None)

    def _bytes_to_text(self, new_token_ids: list[int]) -> str:
        pieces = self.pieces
        size = len(pieces)
        data = self.pending + b"".join(pieces[t] for t in new_token_ids if 0 <= t < size)
        # a character still incomplete when the output ends is dropped, as on the other paths
        cut = complete_utf8_prefix(data)
        self.pending = data[cut:]
        return data[:cut].decode("utf-8", "replace")

    def add_tokens(self, new_token_ids: list[int]) -> None:
        """Decode new tokens into self.text; checks stop strings."""
        if self.stop_hit is not None:
            return
        if self.pieces is not None:
            self._append(self._bytes_to_text(new_token_ids))
            return
        if self.stream is not None:
            if new_token_ids:
                self._append(
                    self.stream.step(
                        self.decoder.backend,
                        new_token_ids[0] if len(new_token_ids) == 1 else list(new_token_ids),
                    )
                )
            return
        self.token_ids.extend(new_token_ids)
        decode = self.decoder.decode
        skip = self.skip_special_tokens
        prefix_text = decode(self.token_ids[self.prefix_offset : self.read_offset], skip)
        full_text = decode(self.token_ids[self.prefix_offset :], skip)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset = max(self.read_offset, len(self.token_ids) - _CONTEXT_TOKENS)
            self.read_offset = len(self.token_ids)
            self._append(full_text[len(prefix_text) :])
        # keep the window bounded
        if self.prefix_offset > 64:
            del self.token_ids[: self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0

    def _append(self, piece: str | None) -> None:
        """New decoded text (None or "" for none yet), checked for stop strings."""
        if piece:
            before = len(self.text)
            self.text += piece
            if self.stop_strings:
                self._check_stop(before)

    def _check_stop(self, new_from: int) -> None:
        longest = max(len(s) for s in self.stop_strings)
        search_from = max(0, new_from - longest + 1)
        best: tuple[int, str] | None = None
        for stop in self.stop_strings:
            idx = self.text.find(stop, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is not None:
            at, stop = best
            self.text = self.text[: at + len(stop) if self.include_stop else at]
            self.stop_hit = stop

    def take_delta(self, final: bool) -> str:
        """New text safe to show: while not final, a tail that could begin a stop string stays."""
        text = self.text
        limit = len(text)
        if not final and self.stop_strings and self.stop_hit is None:
            limit = max(self.emitted, limit - self._held_back())
        emitted = self.emitted
        if emitted == limit:
            return ""
        delta = text[emitted:limit] if emitted or limit < len(text) else text
        cut = limit - self.keep
        if cut > 0:  # what was handed out is not needed any more (but a stop string's start)
            self.text = text[cut:]
            limit -= cut
        self.emitted = limit
        return delta

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        held = 0
        for stop in self.stop_strings:
            for k in range(min(len(stop) - 1, len(self.text)), held, -1):
                if self.text.endswith(stop[:k]):
                    held = k
                    break
        return held
