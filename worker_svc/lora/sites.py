"""Where a LoRA adapter applies in a decoder layer: the seven projections, grouped into the
four places the model adds deltas (one input each, so their shrinks share one pass over it)."""

from __future__ import annotations

# site -> the projections of that one input, in the order of the model's outputs
SITES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
MODULES = tuple(module for parts in SITES.values() for module in parts)
PARENT = {
    **dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj"), "self_attn"),
    **dict.fromkeys(("gate_proj", "up_proj", "down_proj"), "mlp"),
}
