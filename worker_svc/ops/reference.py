"""The reference backend: every op of the table in plain torch, on any device (CPU, CUDA).

It is the definition the native backend is tested against, what `--kernels reference` runs, and
what a CUDA worker runs. Each op computes what the Hugging Face Llama modules compute (same
formulas, same places of rounding to the model's dtype), so the model implementation over these
ops gives transformers' logits to within the reordering of a GEMM's sums.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from worker_svc.lora import lora_ops
from worker_svc.lora.adapter_slots import SiteSlots
from worker_svc.lora.step_lora import StepLora
from worker_svc.native_attention import PagedDecodeKernel

Linear = Callable[[torch.Tensor], torch.Tensor]


class ReferenceLinear:
    kind = "torch"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class SplitLinear:
    """Several projections of one input as one GEMM over their weights laid end to end; the
    outputs are views of its columns."""

    def __init__(self, linear: Linear, sizes: tuple[int, ...]) -> None:
        self.linear, self.sizes = linear, sizes

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x).split(self.sizes, dim=-1)


class GatedProduct:
    """silu(x @ gate^T) * (x @ up^T): the SiLU-gated MLP's input half."""

    def __init__(self, gate_up: Linear, intermediate: int) -> None:
        self.gate_up, self.intermediate = gate_up, intermediate

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.activate(*self.pre_activations(x))

    def pre_activations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """gate(x) and up(x), before the SiLU (where LoRA adds its deltas)."""
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        return gate, up

    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


class ReferenceOps:
    name = "reference"
    # the native backend's paged attention kernel; None: gather + SDPA (worker_svc.attention)
    attention_kernel: PagedDecodeKernel | None = None
    native_prefill = False

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype

    def bind_cache(self, cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
        """Told the KV cache's layout once it exists (the native kernels check what they take)."""

    # --- weights, prepared once at load ---

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        return ReferenceLinear(weight, bias)

    def qkv(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> SplitLinear:
        """q, k and v of one input: (q, k, v) views of one GEMM's output."""
        return SplitLinear(
            self.linear(*_joined(weights, biases)), tuple(w.shape[0] for w in weights)
        )

    def gated_product(self, gate: torch.Tensor, up: torch.Tensor) -> Linear:
        return GatedProduct(self.linear(torch.cat([gate, up])), gate.shape[0])

    # --- elementwise ---

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def add_rms_norm_(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """x += delta (the residual stream, in place), then the RMSNorm of x."""
        x.add_(delta)
        return self.rms_norm(x, weight, eps)

    def rotary_tables(
        self, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, head_dim] in the model's dtype, computed in float32 as HF does."""
        freqs = positions[:, None].float() * inv_freq.to(positions.device)[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * scaling).to(self.dtype), (angles.sin() * scaling).to(self.dtype)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated in the rotate-half form; a new tensor."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None] + rotated * sin[:, None]

    def argmax(self, logits: torch.Tensor) -> torch.Tensor | None:
        """A native row-wise argmax where there is one; None: the sampler uses torch's."""
        return None

    def add_lora_(
        self, x: torch.Tensor, outs: tuple[torch.Tensor, ...], site: SiteSlots, step: StepLora
    ) -> None:
        """outs (one site's projections of x, in place) += each token's adapter's deltas."""
        lora_ops.add_lora_(x, outs, site, step)


def _joined(
    weights: list[torch.Tensor], biases: list[torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.cat(weights)
    if all(b is None for b in biases):
        return weight, None
    parts = [
        b if b is not None else w.new_zeros(w.shape[0])
        for w, b in zip(weights, biases, strict=True)
    ]
    return weight, torch.cat(parts)
