"""Load a decoder-only Hugging Face model for the runner: device, dtype, converted-GGUF cache.

A GGUF model is dequantized by transformers (`gguf_file=`), which is slow even for a small
model; the float32 result is saved once as safetensors (with config and tokenizer files) under
`ModelSource.converted_dir`, and every later load reads that directory, which is far quicker.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import torch

from common.model_source import ModelSource, write_atomically
from common.tokenizer import tokenizer_dir

log = logging.getLogger("splitserve.worker.model_loader")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def model_dir(source: ModelSource) -> Path:
    """A Hugging Face directory for `source`: itself, or its cached GGUF conversion."""
    if source.kind == "hf":
        return source.path
    target = source.converted_dir
    if not (target / "config.json").is_file():
        started = time.perf_counter()
        write_atomically(target, lambda tmp: convert_gguf(source, tmp))
        log.info("converted %s to %s in %.1f s", source.path, target, time.perf_counter() - started)
    return target


def convert_gguf(source: ModelSource, out_dir: Path) -> None:
    """Dequantize a GGUF model to float32 safetensors (+ config, tokenizer) in `out_dir`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        source.path.parent, gguf_file=source.path.name, dtype=torch.float32
    )
    # save_pretrained refuses a quantized model; the weights are plain float32 by now
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    for item in tokenizer_dir(source).iterdir():
        shutil.copy2(item, out_dir / item.name)


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The transformers model in eval mode on `device`: the weights the model implementation
    (worker_svc.model) takes; its forward is not run."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = model_dir(source)
    config = AutoConfig.from_pretrained(path)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"model {source.name!r} is encoder-decoder; only decoder-only models run")
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "softcap", None):
        raise ValueError(f"model {source.name!r} uses attention soft-capping, not supported")
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model
