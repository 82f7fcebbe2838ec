"""Read a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) into host
memory, checked against the base model, in the layout of a device slot (adapter_slots.py).

Per layer and site (sites.py): A of every part stacked [parts * max_rank, in] and each part's B
transposed [max_rank, out], zero-padded to max_rank, float32 (PEFT keeps adapter weights in
float32 under a bfloat16 model and computes the delta in float32); the scaling lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora; rank_pattern / alpha_pattern per module) and the rank
of each part. Anything whose forward is not plain LoRA on the seven projections is refused.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from worker_svc.lora.sites import MODULES, PARENT, SITES

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# adapter_config.json options that change the forward beyond plain LoRA: refused when set
_REFUSED = {
    "use_dora": "DoRA",
    "fan_in_fan_out": "fan_in_fan_out",
    "lora_bias": "lora_bias",
    "modules_to_save": "modules_to_save",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters",
    "alora_invocation_tokens": "aLoRA",
    "arrow_config": "Arrow routing",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "BD-LoRA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
    "kasa_config": "KaSA",
}


class LoraLoadError(ValueError):
    """An adapter that cannot be served here; the message is one sentence naming why."""


@dataclass(slots=True, frozen=True)
class LoraInfo:
    name: str
    path: str
    rank: int  # the largest rank of its modules
    target_modules: tuple[str, ...]


@dataclass(slots=True, frozen=True)
class BaseShapes:
    """What an adapter must fit: the layers and each projection's (out, in) features."""

    num_layers: int
    features: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, hf_model: torch.nn.Module, num_layers: int) -> BaseShapes:
        layer = hf_model.model.layers[0]
        parent = {"self_attn": layer.self_attn, "mlp": layer.mlp}
        features = {m: tuple(getattr(parent[PARENT[m]], m).weight.shape) for m in MODULES}
        return cls(num_layers, features)


@dataclass(slots=True)
class SiteWeights:
    a: torch.Tensor  # [parts * max_rank, in] float32
    b: tuple[torch.Tensor, ...]  # per part [max_rank, out] float32
    scale: torch.Tensor  # [parts] float32
    rank: torch.Tensor  # [parts] int32; 0 where the adapter leaves the part alone


@dataclass(slots=True)
class AdapterWeights:
    info: LoraInfo
    layers: list[dict[str, SiteWeights]]  # per layer, the sites the adapter targets

    @property
    def nbytes(self) -> int:
        return sum(
            s.a.nbytes + sum(b.nbytes for b in s.b) for sites in self.layers for s in sites.values()
        )


def read_adapter(name: str, path: str, base: BaseShapes, max_rank: int) -> AdapterWeights:
    """The adapter at `path`, checked against `base`; LoraLoadError (one sentence) otherwise."""
    where = f"LoRA adapter {name!r} at {path}"
    directory = Path(path)
    if not directory.is_dir():
        raise LoraLoadError(f"{where}: no such directory")
    config = _read_config(directory / CONFIG_FILE, where)
    tensors = _read_tensors(directory / WEIGHTS_FILE, where)
    pairs = _pair_up(tensors, base, where)
    if not pairs:
        raise LoraLoadError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    layers: list[dict[str, SiteWeights]] = [{} for _ in range(base.num_layers)]
    for (layer, module), (a, b) in sorted(pairs.items()):
        out_features, in_features = base.features[module]
        rank = a.shape[0]
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise LoraLoadError(
                f"{where}: layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                f"which do not fit this model's {out_features}x{in_features} projection"
            )
        if rank > max_rank:
            raise LoraLoadError(f"{where}: rank {rank} > max_lora_rank {max_rank}")
        key = f"model.layers.{layer}.{PARENT[module]}.{module}"
        if rank != _pattern(rank_pattern, key, config["r"]):
            raise LoraLoadError(f"{where}: layer {layer} {module} has rank {rank}, not its r")
        alpha = float(_pattern(alpha_pattern, key, config["lora_alpha"]))
        scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        _place(layers[layer], module, a, b, scale, base, max_rank)
    targets = tuple(m for m in MODULES if any(m == module for _, module in pairs))
    rank = max(a.shape[0] for a, _ in pairs.values())
    return AdapterWeights(LoraInfo(name, str(path), rank, targets), layers)


def _read_config(path: Path, where: str) -> dict:
    if not path.is_file():
        raise LoraLoadError(f"{where}: no {CONFIG_FILE}")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraLoadError(f"{where}: {CONFIG_FILE} is not readable JSON ({exc})") from exc
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise LoraLoadError(f"{where}: {CONFIG_FILE} is not a PEFT LoRA config")
    for option, what in _REFUSED.items():
        if config.get(option):
            raise LoraLoadError(f"{where}: {what} ({option}) is not supported")
    if config.get("bias", "none") != "none":
        raise LoraLoadError(f"{where}: bias={config['bias']!r} is not supported (only 'none')")
    targets = config.get("target_modules")
    if isinstance(targets, list) and (outside := sorted(set(targets) - set(MODULES))):
        raise LoraLoadError(f"{where}: target modules {outside} are not among {list(MODULES)}")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or r <= 0 or not isinstance(alpha, int | float):
        raise LoraLoadError(f"{where}: {CONFIG_FILE} needs a positive int r and a lora_alpha")
    return config


def _read_tensors(path: Path, where: str) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise LoraLoadError(f"{where}: no {WEIGHTS_FILE}")
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except Exception as exc:  # the reader's errors are its own types: any is a bad file
        raise LoraLoadError(f"{where}: {WEIGHTS_FILE} is not readable ({exc})") from exc


def _pair_up(
    tensors: dict[str, torch.Tensor], base: BaseShapes, where: str
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A, B) as float32, every key accounted for."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match[3] not in MODULES or PARENT[match[3]] != match[2]:
            raise LoraLoadError(f"{where}: {key} is not a LoRA weight of {', '.join(MODULES)}")
        layer = int(match[1])
        if layer >= base.num_layers:
            raise LoraLoadError(f"{where}: layer {layer} is past this model's {base.num_layers}")
        if not tensor.is_floating_point() or tensor.dim() != 2:
            raise LoraLoadError(f"{where}: {key} is not a float matrix")
        tensor = tensor.to(torch.float32)
        if not torch.isfinite(tensor).all():
            raise LoraLoadError(f"{where}: {key} holds a NaN or an infinity")
        halves.setdefault((layer, match[3]), {})[match[4]] = tensor
    for (layer, module), half in halves.items():
        if len(half) != 2:
            raise LoraLoadError(f"{where}: layer {layer} {module} lacks its lora_A or lora_B")
    return {k: (h["A"], h["B"]) for k, h in halves.items()}


def _pattern(patterns: dict, key: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first pattern the module name ends on."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _place(
    sites: dict[str, SiteWeights],
    module: str,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    base: BaseShapes,
    max_rank: int,
) -> None:
    site = next(s for s, parts in SITES.items() if module in parts)
    parts = SITES[site]
    if site not in sites:
        sites[site] = SiteWeights(
            a=torch.zeros(len(parts) * max_rank, a.shape[1]),
            b=tuple(torch.zeros(max_rank, base.features[m][0]) for m in parts),
            scale=torch.zeros(len(parts)),
            rank=torch.zeros(len(parts), dtype=torch.int32),
        )
    weights, p, rank = sites[site], parts.index(module), a.shape[0]
    weights.a[p * max_rank : p * max_rank + rank] = a
    weights.b[p][:rank] = b.t()
    weights.scale[p], weights.rank[p] = scale, rank
