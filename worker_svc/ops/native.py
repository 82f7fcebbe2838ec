"""The native backend: the CPU kernels this machine's level runs, each op falling back to the
reference one where its kernel is missing here or does not take the inputs.

Chosen once at load (worker_svc.ops.select): the linear kind from the dtype, the quantization
and the CPU (native_linear.py), the fused elementwise kernels (fused_ops.py, avx2 level and up),
the paged attention kernels reading K/V in place through the block table (native_attention.py;
the prefill one in AVX-512 builds, SDPA per chunk elsewhere).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_svc import fused_ops, native_attention, packed_gemm, quantization
from worker_svc.lora import native_lora
from worker_svc.lora.adapter_slots import SiteSlots
from worker_svc.lora.step_lora import StepLora
from worker_svc.ops import native_linear
from worker_svc.ops.native_linear import AMX_MAX_ROWS, AmxLinear
from worker_svc.ops.reference import Linear, ReferenceOps, SplitLinear


class SeparateLinears:
    """q, k and v as three linears of one input: for the packed GEMM where the projections'
    widths are not whole panels (a joined packing's slices could not serve each alone, as the
    decode stack needs them)."""

    def __init__(self, linears: list[Linear]) -> None:
        self.linears = linears
        self.sizes = tuple(linear.out_features for linear in linears)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(linear(x) for linear in self.linears)


class NativeGatedProduct:
    """silu(x @ gate^T) * (x @ up^T): on AMX one kernel pass over a gate/up panel-pair packing
    (decode sizes); elsewhere the two linears and the native SiLU product."""

    def __init__(self, ops: NativeOps, gate: torch.Tensor, up: torch.Tensor) -> None:
        self.intermediate = gate.shape[0]
        self.gate, self.up = ops.linear(gate), ops.linear(up)
        self._ops = ops.fused
        self.amx, self.gate_up_packed = None, None
        if isinstance(self.gate, AmxLinear) and isinstance(self.up, AmxLinear):
            self.amx = self.gate.gemm
            self.gate_up_packed = self.amx.pack_gate_up(gate, up)
            self.gate.packed_weight = self.up.packed_weight = None  # oneDNN past AMX sizes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.amx is not None and x.shape[0] <= AMX_MAX_ROWS:
            if x.stride(-1) != 1:
                x = x.contiguous()
            return self.amx.gate_up_silu(x, self.gate_up_packed, self.intermediate)
        return self.activate(self.gate(x), self.up(x))

    def pre_activations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """gate(x) and up(x), before the SiLU (where LoRA adds its deltas)."""
        if self.amx is not None:  # the AMX packing is the fused pair's: the plain weights here
            gate, up = self.gate, self.up
            return F.linear(x, gate.weight, gate.bias), F.linear(x, up.weight, up.bias)
        return self.gate(x), self.up(x)

    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self._ops is None or gate.dtype not in fused_ops.DTYPES:
            return F.silu(gate) * up
        return self._ops.silu_mul_(gate.contiguous(), up.contiguous())


class NativeOps(ReferenceOps):
    name = "native"

    def __init__(self, dtype: torch.dtype, quantization_method: str = "none") -> None:
        super().__init__(torch.device("cpu"), dtype)
        quantization.check_supported(quantization_method, self.device, dtype, "native")
        self.quantization = quantization_method
        self.linear_kind = native_linear.linear_kind(dtype, quantization_method)
        self.fused = fused_ops.load() if dtype in fused_ops.DTYPES else None
        self.lora_kernel = native_lora.load()

    def bind_cache(self, cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
        kernel = native_attention.load()
        if kernel is None or not kernel.supports(cache):
            return
        self.attention_kernel = kernel
        self.native_prefill = kernel.supports_prefill(cache, num_heads, num_kv_heads, head_dim)

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        return native_linear.make_linear(self.linear_kind, weight, bias)

    def qkv(
        self, weights: list[torch.Tensor], biases: list[torch.Tensor | None]
    ) -> SplitLinear | SeparateLinears:
        if self.linear_kind in ("native-packed", "int8-packed"):
            width = packed_gemm.load().panel_width
            if any(w.shape[0] % width for w in weights):
                pairs = zip(weights, biases, strict=True)
                return SeparateLinears([self.linear(w, b) for w, b in pairs])
        return super().qkv(weights, biases)

    def gated_product(self, gate: torch.Tensor, up: torch.Tensor) -> Linear:
        return NativeGatedProduct(self, gate, up)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.fused is None or x.dtype != weight.dtype or x.dtype not in fused_ops.DTYPES:
            return super().rms_norm(x, weight, eps)
        return self.fused.rms_norm(x, weight, eps)

    def add_rms_norm_(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if (
            self.fused is None
            or not x.dtype == delta.dtype == weight.dtype
            or x.dtype not in fused_ops.DTYPES
            or x.stride(-1) != 1
            or delta.stride(-1) != 1
        ):
            return super().add_rms_norm_(x, delta, weight, eps)
        return self.fused.add_rms_norm_(x, delta, weight, eps)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        tokens, _, head_dim = x.shape
        if (
            self.fused is None
            or head_dim % 32
            or not x.dtype == cos.dtype == sin.dtype
            or x.dtype not in fused_ops.DTYPES
            or x.stride(-1) != 1
            or cos.stride() != sin.stride()
            or cos.stride(-1) != 1
        ):
            return super().rotary(x, cos, sin)
        # the kernel's layout: [1, heads, T, head_dim] in, laid out [T, heads, head_dim] out
        out = self.fused.rotary(x.transpose(0, 1).unsqueeze(0), cos.unsqueeze(0), sin.unsqueeze(0))
        return out[0].transpose(0, 1)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor | None:
        return None if self.fused is None else self.fused.argmax(logits)

    def add_lora_(
        self, x: torch.Tensor, outs: tuple[torch.Tensor, ...], site: SiteSlots, step: StepLora
    ) -> None:
        if self.lora_kernel is None or not self.lora_kernel.takes(x, outs):
            return super().add_lora_(x, outs, site, step)
        self.lora_kernel.add_(x, outs, site, step)
