"""The model's tokenizer, without torch or transformers (the scheduler process has neither).

Backed by the `tokenizers` library. A Hugging Face directory brings its own `tokenizer.json`
(and `tokenizer_config.json` / `chat_template.jinja`); for a GGUF model the tokenizer is rebuilt
from the file's metadata the way transformers does it for byte-level BPE vocabularies
(`tokenizer.ggml.model == "gpt2"`: SmolLM2, Llama 3, Qwen 2...) and cached as those same files
under `ModelSource.tokenizer_cache_dir`, so later loads read one JSON file.
Chat templates are rendered with jinja2 like transformers' `apply_chat_template`.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from common.byte_pieces import BytePieces, build_byte_pieces
from common.model_source import ModelSource, read_gguf_metadata, resolve_model, write_atomically

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"

# pre-tokenizer splits for GGUF `tokenizer.ggml.pre` names (as transformers' GGUF integration)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}
_CONTROL, _USER_DEFINED = 3, 4


@dataclass(slots=True, frozen=True)
class LengthBound:
    """Every byte of a text ends up in one token of at most `longest` bytes, except the bytes
    of `dropped`, which no token stands for (the tokenizer leaves them out): so a text is at
    least (its UTF-8 bytes but those) / longest tokens."""

    longest: int
    dropped: bytes = b""

    def least_tokens(self, text: str) -> int:
        data = text.encode("utf-8", "surrogatepass")
        covered = len(data.translate(None, self.dropped)) if self.dropped else len(data)
        return -(-covered // self.longest)


@dataclass(slots=True)
class Tokenizer:
    backend: tokenizers.Tokenizer
    name: str = ""
    chat_template: str | None = None
    special_tokens: dict[str, str | None] = field(default_factory=dict)  # bos/eos/pad/unk
    add_bos_token: bool = False
    _byte_pieces: list = field(default_factory=list, repr=False, compare=False)  # [table|None]
    _length_bound: list = field(default_factory=list, repr=False, compare=False)  # [bound|None]

    def byte_pieces(self) -> BytePieces | None:
        """Token id -> bytes when this is a byte-level BPE tokenizer (built once: a pass over the
        whole vocabulary)."""
        if not self._byte_pieces:
            self._byte_pieces.append(build_byte_pieces(self.backend))
        return self._byte_pieces[0]

    def length_bound(self) -> LengthBound | None:
        """A lower bound on a text's token count that costs no tokenizing (computed once);
        None where this tokenizer allows none (see _length_bound)."""
        if not self._length_bound:
            self._length_bound.append(_length_bound(self))
        return self._length_bound[0]

    def token_id(self, role: str) -> int | None:
        token = self.special_tokens.get(role)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self.token_id("pad_token")

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> list[int] | str:
        """Render `messages` with the model's chat template; token ids unless tokenize=False.
        `continue_final_message` (as transformers): the text ends with the last message's
        content, left open (the end of turn the template writes after it is cut)."""
        if not self.chat_template:
            raise ValueError(f"model {self.name!r} has no chat template")
        text = _render(
            self.chat_template, messages, add_generation_prompt, self.special_tokens, extra
        )
        if continue_final_message:
            text = _open_final_message(text, messages[-1].get("content") or "")
        return self.encode(text, add_special_tokens=False) if tokenize else text


# pre-tokenizers that only split the text, never drop a part of it
_SPLITTING = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}


def _keeps_every_byte(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return True
    if pre_tokenizer.get("type") == "Sequence":
        return all(_keeps_every_byte(p) for p in pre_tokenizer.get("pretokenizers", ()))
    return pre_tokenizer.get("type") in _SPLITTING and pre_tokenizer.get("behavior") != "Removed"


def _length_bound(tok: Tokenizer) -> LengthBound | None:
    """The longest token of the vocabulary (special and added tokens too) in bytes, for a BPE
    model that keeps every byte of the text but those it has no token for: no normalizer (one
    may shrink the text: NFKC, Strip), no pre-tokenizer that drops what it splits on
    (Whitespace), no added token that strips the whitespace beside it (it takes any run).
    Byte-level vocabularies are measured by their byte table; a byte with no token of its own
    is dropped by BPE, so it is not counted. Any other BPE is measured by the UTF-8 length of
    its tokens' text (never less than the bytes one stands for), and needs byte fallback or an
    unknown token for one character (at most 4 bytes) at a time: without either a character
    outside the vocabulary is dropped, with fuse_unk a whole run is one token: no bound."""
    config = json.loads(tok.backend.to_str())
    model = config.get("model") or {}
    if model.get("type") != "BPE":
        return None
    if any(t.lstrip or t.rstrip for t in tok.backend.get_added_tokens_decoder().values()):
        return None
    if config.get("normalizer") is not None or not _keeps_every_byte(config.get("pre_tokenizer")):
        return None
    table = tok.byte_pieces()
    if table is not None:
        alone = {p[0] for p in table.pieces if len(p) == 1}
        dropped = bytes(b for b in range(256) if b not in alone)
        return LengthBound(max(map(len, table.pieces)), dropped)
    if not (model.get("byte_fallback") or (model.get("unk_token") and not model.get("fuse_unk"))):
        return None
    longest = max(len(t.encode()) for t in tok.backend.get_vocab(with_added_tokens=True))
    return LengthBound(max(longest, 4))


def load_tokenizer(model: str | os.PathLike[str] | ModelSource | None = None) -> Tokenizer:
    """The tokenizer of `model` (anything `resolve_model` accepts, or a ModelSource)."""
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    return _from_dir(tokenizer_dir(source), source.name)


def tokenizer_dir(source: ModelSource) -> Path:
    """A directory with tokenizer.json and tokenizer_config.json for `source` (built if needed)."""
    if source.kind == "hf":
        if not (source.path / TOKENIZER_FILE).is_file():
            raise ValueError(f"model {source.name!r} at {source.path} has no {TOKENIZER_FILE}")
        return source.path
    target = source.tokenizer_cache_dir
    if not (target / TOKENIZER_FILE).is_file():
        write_atomically(target, lambda tmp: save_gguf_tokenizer(source.path, tmp))
    return target


def save_gguf_tokenizer(gguf_path: str | os.PathLike[str], out_dir: Path) -> None:
    """Build the tokenizer described by a GGUF file's metadata and save it as HF files."""
    meta = read_gguf_metadata(gguf_path)
    backend = _gguf_backend(meta)
    tokens = meta["tokenizer.ggml.tokens"]
    special = {
        role: tokens[meta[key]] if key in meta else None
        for role, key in (
            ("bos_token", "tokenizer.ggml.bos_token_id"),
            ("eos_token", "tokenizer.ggml.eos_token_id"),
            ("unk_token", "tokenizer.ggml.unknown_token_id"),
            ("pad_token", "tokenizer.ggml.padding_token_id"),
        )
    }
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **special}
    config["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    out_dir.mkdir(parents=True, exist_ok=True)
    backend.save(str(out_dir / TOKENIZER_FILE))
    template = meta.get("tokenizer.chat_template")
    if template:
        (out_dir / TEMPLATE_FILE).write_text(template)
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2))


def _gguf_backend(meta: dict[str, Any]) -> tokenizers.Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer type {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
            f"use the model's Hugging Face directory instead"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    backend = tokenizers.Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    split = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    if meta.get("tokenizer.ggml.add_bos_token") and "tokenizer.ggml.bos_token_id" in meta:
        bos = tokens[meta["tokenizer.ggml.bos_token_id"]]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 $B:1",
            special_tokens=[(bos, meta["tokenizer.ggml.bos_token_id"])],
        )
    control = [
        t for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL and set(t) <= alphabet
    ]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED and t in vocab]
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return backend


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs = list(bs)
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _from_dir(path: Path, name: str) -> Tokenizer:
    backend = tokenizers.Tokenizer.from_file(str(path / TOKENIZER_FILE))
    config: dict[str, Any] = {}
    if (path / CONFIG_FILE).is_file():
        config = json.loads((path / CONFIG_FILE).read_text())
    template = config.get("chat_template")
    if (path / TEMPLATE_FILE).is_file():
        template = (path / TEMPLATE_FILE).read_text()
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    special = {
        role: _token_text(config.get(role))
        for role in ("bos_token", "eos_token", "pad_token", "unk_token")
    }
    return Tokenizer(backend, name, template, special, bool(config.get("add_bos_token", False)))


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # a serialized AddedToken
        return value.get("content")
    return value


def _render(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    special_tokens: dict[str, str | None],
    extra: dict[str, Any],
) -> str:
    variables = {k: v for k, v in special_tokens.items() if v is not None}
    return _compile(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **variables, **extra
    )


def _open_final_message(text: str, content: str) -> str:
    """`text` up to the end of its last copy of `content` (stripped, if the template strips
    it)."""
    for wanted in (content, content.strip()):
        at = text.rfind(wanted) if wanted else -1
        if at >= 0:
            return text[: at + len(wanted)]
    raise ValueError("continue_final_message: the template does not write the last message as sent")


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    """A compiled jinja2 template, with the globals transformers' chat templates expect."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:  # pragma: no cover - jinja2 ships with the project's environment
        raise ImportError("chat templates need the jinja2 package (pip install jinja2)") from exc

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template error: {message}")

    def tojson(value: Any, indent: int | None = None, **_: Any) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)
