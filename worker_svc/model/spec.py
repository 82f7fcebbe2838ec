"""What the model implementation needs to know of a Hugging Face causal LM, read from its config.

The Llama family shares one decoder: pre-norm RMSNorm, rotary position embedding in the
rotate-half form, grouped-query attention, a SiLU-gated MLP. The members differ in a few switches
this spec carries: biases on q/k/v (Qwen2), a per-head RMSNorm on q and k before rotary (Qwen3),
a tied lm_head (SmolLM2, small Qwen), the rotary frequencies (Llama 3's scaling, YaRN; taken
from the loaded model's rotary module, so every static rope type transformers knows is covered).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# architecture -> does it norm q and k per head before rotary
ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": False,
    "Qwen3ForCausalLM": True,
}
# rope types whose frequencies depend on the sequence seen so far: one table cannot serve them
_DYNAMIC_ROPE = frozenset({"dynamic", "longrope"})


class UnsupportedModel(ValueError):
    """A model this implementation does not compute; the message says what differs."""


@dataclass(slots=True, frozen=True)
class ModelSpec:
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    qk_norm: bool
    tie_word_embeddings: bool
    inv_freq: torch.Tensor  # [head_dim / 2] float32
    rope_scaling: float  # multiplies cos and sin (YaRN's attention factor; 1 elsewhere)

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


def spec_of(model: torch.nn.Module) -> ModelSpec:
    """The spec of a loaded transformers model; UnsupportedModel where it is not one of
    ARCHITECTURES or uses a part this implementation does not compute."""
    arch = type(model).__name__
    if arch not in ARCHITECTURES:
        raise UnsupportedModel(
            f"{arch} is not implemented; the worker runs {', '.join(sorted(ARCHITECTURES))}"
        )
    cfg = model.config.get_text_config()
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"{arch} with hidden_act={act!r}: only SiLU-gated MLPs run")
    if getattr(cfg, "mlp_bias", False):
        raise UnsupportedModel(f"{arch} with mlp_bias: the gated MLP here has no biases")
    rotary = model.model.rotary_emb
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type in _DYNAMIC_ROPE:
        raise UnsupportedModel(f"{arch} with rope type {rope_type!r} (frequencies that change)")
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return ModelSpec(
        architecture=arch,
        num_layers=int(cfg.num_hidden_layers),
        hidden_size=int(cfg.hidden_size),
        num_heads=heads,
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        intermediate_size=int(cfg.intermediate_size),
        vocab_size=int(cfg.vocab_size),
        rms_norm_eps=float(cfg.rms_norm_eps),
        qk_norm=ARCHITECTURES[arch],
        tie_word_embeddings=bool(getattr(model.config, "tie_word_embeddings", False)),
        inv_freq=rotary.inv_freq.detach().to(device="cpu", dtype=torch.float32).clone(),
        rope_scaling=float(getattr(rotary, "attention_scaling", 1.0)),
    )
