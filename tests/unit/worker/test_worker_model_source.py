"""Model resolution, the converted-weight cache, and the torch-free tokenizer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.model_source import (
    DEFAULT_MODEL_NAME,
    cache_dir,
    read_gguf_metadata,
    resolve_model,
)
from common.tokenizer import load_tokenizer, tokenizer_dir


def test_default_and_aliases(smollm2_path):
    for name in (None, "", "default", "smollm2", "SmolLM2-135M-Instruct"):
        source = resolve_model(name)
        assert source.kind == "gguf" and source.path == smollm2_path
        assert source.name == DEFAULT_MODEL_NAME


def test_unknown_models_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model("no-such-model-anywhere")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(tmp_path / "weights.bin")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="neither"):
        resolve_model(tmp_path)


def test_hf_directory_and_gguf_directory(tiny_llama_dir, tmp_path):
    source = resolve_model(str(tiny_llama_dir))
    assert source.kind == "hf" and source.path == tiny_llama_dir
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    source = resolve_model(tmp_path)
    assert source.kind == "gguf" and source.name == "m"


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path, smollm2_path):
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    source = resolve_model(None)
    assert source.converted_dir.parent == tmp_path / "models"
    assert source.tokenizer_cache_dir.parent == tmp_path / "tokenizers"
    monkeypatch.delenv("SPLITSERVE_CACHE_DIR")
    assert cache_dir() == Path.home() / ".cache" / "splitserve"


def test_gguf_metadata(smollm2_path):
    meta = read_gguf_metadata(smollm2_path)
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == 30
    assert len(meta["tokenizer.ggml.tokens"]) == 49152
    assert "im_start" in meta["tokenizer.chat_template"]


def test_converted_weights_are_cached(monkeypatch, tmp_path):
    """The (slow) conversion runs once per file; a changed file converts anew."""
    pytest.importorskip("torch")
    from worker_svc import model_loader

    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF-1")
    calls = []

    def fake_convert(source, out_dir):
        calls.append(source.path)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(model_loader, "convert_gguf", fake_convert)
    source = resolve_model(gguf)
    first = model_loader.model_dir(source)
    assert model_loader.model_dir(resolve_model(gguf)) == first
    assert len(calls) == 1
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name]  # no temp dirs left
    gguf.write_bytes(b"GGUF-22")
    assert model_loader.model_dir(resolve_model(gguf)) != first
    assert len(calls) == 2


@pytest.mark.slow
def test_smollm2_second_load_does_not_dequantize(monkeypatch):
    pytest.importorskip("torch")
    import torch

    from worker_svc import model_loader

    source = resolve_model(None)
    path = model_loader.model_dir(source)  # converts the first time only
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config

    def refuse(*args, **kwargs):
        raise AssertionError("dequantized again although the converted weights are cached")

    monkeypatch.setattr(model_loader, "convert_gguf", refuse)
    model = model_loader.load_model(source, torch.float32, torch.device("cpu"))
    assert model.config.num_hidden_layers == 30


def test_tokenizer_loads_without_torch():
    code = (
        "import sys, common.tokenizer as t\n"
        "tok = t.load_tokenizer()\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
        "print(tok.eos_token_id, tok.encode('Hello world'))\n"
    )
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "2"


def test_tokenizer_encode_decode_chat_template(smollm2_path):
    tok = load_tokenizer()
    assert (tok.eos_token_id, tok.bos_token_id, tok.vocab_size) == (2, 1, 49152)
    text = "naïve café — “quotes” 日本語 🎉\n\tcode(x) **2"
    assert tok.decode(tok.encode(text)) == text
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert ids[0] == 1 and tok.decode(ids, skip_special_tokens=False) == rendered


def test_tokenizer_from_an_hf_directory(tmp_path, smollm2_path):
    source = resolve_model(None)
    for item in tokenizer_dir(source).iterdir():
        shutil.copy2(item, tmp_path / item.name)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    tok = load_tokenizer(str(tmp_path))
    assert tok.encode("Hello there") == load_tokenizer().encode("Hello there")
    assert tok.eos_token_id == 2 and tok.chat_template
    os.remove(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    tok = load_tokenizer()
    texts = [
        "Hello world",
        "  leading spaces and trailing  ",
        "naïve café — “quotes” 日本語 🎉",
        "code:\n\tdef f(x):\n\t\treturn x**2  # hi",
        "<|im_start|>user\nhi<|im_end|>",
        "123456789 3.14159 don't I'll WE'RE",
    ]
    for text in texts:
        assert tok.encode(text) == hf(text).input_ids, text
        assert tok.decode(tok.encode(text)) == hf.decode(
            hf(text).input_ids, skip_special_tokens=True
        )
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == hf.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False
    )
