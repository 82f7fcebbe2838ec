"""Faster linear layers for the CPU forward, swapped into the stock Hugging Face model.

`optimize_linears(model, quantization)` picks one kind per dtype from what the CPU can run
(cpu_caps) and replaces each nn.Linear; the model's forward code is untouched. Weights are copied
once at load; a tied lm_head gets its own copy.

- float32: `NativePackedLinear`, the native GEMM over a weight packed once into its panel layout
  (worker_svc/packed_gemm.py; AVX-512 or AVX2), which streams each panel once per call where
  BLAS re-packs the weight on every call. Without the native library, `TransposedLinear`: MKL
  on the weight stored transposed, which MKL multiplies faster than nn.Linear's layout.
- bfloat16 with AMX: `AmxLinear`, our AMX kernel's packed copy for decode-sized inputs, oneDNN
  on the plain weight past AMX_MAX_ROWS rows (faster inside a prefill step).
- bfloat16 with AVX-512 (oneDNN's bfloat16 GEMM): `PackedLinear`, a copy packed once in
  oneDNN's layout for decode-sized inputs, the plain weight for larger ones (for which oneDNN's
  per-call layout is faster).
- bfloat16 on AVX2 (no bfloat16 arithmetic; oneDNN refuses it): `NativePackedLinear` on the
  native GEMM's bfloat16 entry, which widens each weight to float32 in its inner loop.
- otherwise torch's own nn.Linear.
- `--quantization int8`, float32 or bfloat16, whatever the CPU level above: `Int8PackedLinear`,
  the native GEMM over the weight quantized to int8 with a scale per output channel
  (worker_svc/quantization.py) and packed once into its panel layout; the activations keep the
  model's dtype. Refused (quantization.Unsupported) where that GEMM is missing.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from worker_svc import amx_gemm, cpu_caps, packed_gemm, quantization

log = logging.getLogger("splitserve.worker.fast_linear")


class TransposedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        bias = linear.bias
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.bias is None:
            out = flat @ self.weight_t
        else:
            out = torch.addmm(self.bias, flat, self.weight_t)
        return out.view(*x.shape[:-1], self.out_features)


class NativePackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, gemm: packed_gemm.PackedGemm) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._gemm = gemm
        packed = gemm.pack(linear.weight.detach())
        self.packed_weight = nn.Parameter(packed, requires_grad=False)
        bias = linear.bias
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        return self._gemm(x, self.packed_weight, self.out_features, self.bias)


class Int8PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, gemm: packed_gemm.PackedGemm) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._gemm = gemm
        weight, scale = quantization.quantize_int8(linear.weight)
        self.packed_weight = nn.Parameter(gemm.pack(weight), requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        bias = linear.bias
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        return self._gemm(x, self.packed_weight, self.out_features, self.bias, self.scale)


PACKED_MAX_ROWS = 256  # above this the per-call layout of oneDNN wins (prefill chunks)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, rows_hint: int = 64) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.weight = nn.Parameter(weight.clone(), requires_grad=False)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)
        bias = linear.bias
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // self.in_features <= PACKED_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return nn.functional.linear(x, self.weight, self.bias)


AMX_MAX_ROWS = 512  # above this oneDNN on the plain weight (faster within a prefill step)


class AmxLinear(nn.Module):
    """bfloat16: decode-sized inputs on the AMX kernel's packed copy, larger ones on oneDNN."""

    def __init__(self, linear: nn.Linear, gemm: amx_gemm.AmxGemm) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.gemm = gemm  # also what a fused module computing this layer calls
        weight = linear.weight.detach()
        self.weight = nn.Parameter(weight.clone(), requires_grad=False)
        self.packed_weight = nn.Parameter(gemm.pack(weight), requires_grad=False)
        bias = linear.bias
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        )

    def drop_packed(self) -> None:
        """Free the packed copy (a fused module computes this layer now); oneDNN from here."""
        self.packed_weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dtype != torch.bfloat16
            or self.packed_weight is None
            or x.numel() // self.in_features > AMX_MAX_ROWS
        ):
            return nn.functional.linear(x, self.weight, self.bias)
        if x.stride(-1) != 1:
            x = x.contiguous()
        return self.gemm(x, self.packed_weight, self.out_features, self.bias)


def packing_available(dtype: torch.dtype) -> bool:
    """oneDNN's packed bfloat16/float16 linear: it needs AVX-512 (BW, VL, DQ) on x86."""
    return (
        dtype in (torch.bfloat16, torch.float16)
        and cpu_caps.capabilities().has("avx512")
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def linear_kind(dtype: torch.dtype, quantization_method: str = "none") -> str:
    """The kind of linear layer this machine gives `dtype` weights (what optimize_linears
    builds, and what `splitserve worker --print-capabilities` reports)."""
    if quantization_method == "int8":
        return "int8-packed"
    native = dtype in packed_gemm.DTYPES and packed_gemm.load() is not None
    if native and dtype == torch.float32:
        return "native-packed"
    if dtype == torch.bfloat16 and amx_gemm.load() is not None:
        return "amx-packed"
    if dtype == torch.float32:
        return "transposed"
    if packing_available(dtype):
        return "packed"
    return "native-packed" if native else "stock"


def optimize_linears(model: nn.Module, quantization_method: str = "none") -> str:
    """Swap the model's nn.Linear modules in place (CPU); returns what they became. Raises
    quantization.Unsupported where the quantization cannot run here."""
    dtype = next(model.parameters()).dtype
    quantization.check_supported(quantization_method, torch.device("cpu"), dtype)
    kind = linear_kind(dtype, quantization_method)
    if kind == "stock":
        return kind
    gemm, amx = packed_gemm.load(), amx_gemm.load()

    def make(linear: nn.Linear) -> nn.Module:
        if kind == "int8-packed":
            return Int8PackedLinear(linear, gemm)
        if kind == "native-packed":
            return NativePackedLinear(linear, gemm)
        if kind == "transposed":
            return TransposedLinear(linear)
        if kind == "amx-packed" and amx.supports(linear.in_features, linear.out_features):
            return AmxLinear(linear, amx)
        return PackedLinear(linear) if packing_available(dtype) else linear

    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, make(child))
                replaced += 1
    log.info("%d linear layers now %s", replaced, kind)
    return kind
