"""The native backend's linear layers: one kind per dtype, chosen from what the CPU runs.

- float32: the native GEMM over a weight packed once into its panel layout (packed_gemm.py;
  AVX-512 or AVX2), which streams each panel once per call where BLAS re-packs the weight on
  every call; without the native library, MKL on the weight stored transposed.
- bfloat16 with AMX: the AMX kernel's packed copy for decode-sized inputs, oneDNN on the plain
  weight past AMX_MAX_ROWS rows (faster inside a prefill step).
- bfloat16 with AVX-512 (oneDNN's bfloat16 GEMM): a copy packed once in oneDNN's layout for
  decode-sized inputs, the plain weight for larger ones.
- bfloat16 on AVX2 (no bfloat16 arithmetic; oneDNN refuses it): the native GEMM's bfloat16
  entry, which widens each weight to float32 in its inner loop.
- `--quantization int8`: the native GEMM over the weight quantized to int8 with a scale per
  output channel (quantization.py); the activations keep the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_svc import amx_gemm, cpu_caps, packed_gemm, quantization
from worker_svc.ops.reference import ReferenceLinear

KINDS = {  # kind -> what it is, for people
    "native-packed": "native packed GEMM",
    "int8-packed": "native packed GEMM, int8 weights widened",
    "transposed": "MKL (weight transposed)",
    "amx-packed": "AMX GEMM (decode sizes), oneDNN (prefill)",
    "onednn-packed": "oneDNN, weight packed once (decode sizes)",
    "torch": "torch",
}
ONEDNN_PACKED_MAX_ROWS = 256  # above this the per-call layout of oneDNN wins (prefill chunks)
AMX_MAX_ROWS = 512  # above this oneDNN on the plain weight (faster within a prefill step)


class NativePackedLinear:
    kind = "native-packed"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, gemm) -> None:
        self.out_features = weight.shape[0]
        self.gemm = gemm
        self.packed_weight = gemm.pack(weight)
        self.bias, self.scale = bias, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        return self.gemm(x, self.packed_weight, self.out_features, self.bias, self.scale)


class Int8PackedLinear(NativePackedLinear):
    kind = "int8-packed"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, gemm) -> None:
        quantized, scale = quantization.quantize_int8(weight)
        super().__init__(quantized, bias, gemm)
        self.scale = scale


class TransposedLinear:
    kind = "transposed"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features = weight.shape[0]
        self.weight_t, self.bias = weight.t().contiguous(), bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.weight_t.shape[0])
        out = (
            flat @ self.weight_t
            if self.bias is None
            else torch.addmm(self.bias, flat, self.weight_t)
        )
        return out.view(*x.shape[:-1], self.out_features)


class OneDnnPackedLinear:
    kind = "onednn-packed"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features = weight.shape[0]
        self.weight, self.bias = weight, bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // self.weight.shape[1] <= ONEDNN_PACKED_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class AmxLinear:
    kind = "amx-packed"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, gemm) -> None:
        self.out_features = weight.shape[0]
        self.gemm = gemm
        self.weight, self.bias = weight, bias
        self.packed_weight = gemm.pack(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // self.weight.shape[1] > AMX_MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        if x.stride(-1) != 1:
            x = x.contiguous()
        return self.gemm(x, self.packed_weight, self.out_features, self.bias)


def onednn_packing_available(dtype: torch.dtype) -> bool:
    """oneDNN's packed bfloat16/float16 linear: it needs AVX-512 (BW, VL, DQ) on x86."""
    return (
        dtype in (torch.bfloat16, torch.float16)
        and cpu_caps.capabilities().has("avx512")
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def linear_kind(dtype: torch.dtype, quantization_method: str = "none") -> str:
    """The kind of linear this machine gives `dtype` weights."""
    if quantization_method == "int8":
        return "int8-packed"
    native = dtype in packed_gemm.DTYPES and packed_gemm.load() is not None
    if native and dtype == torch.float32:
        return "native-packed"
    if dtype == torch.bfloat16 and amx_gemm.load() is not None:
        return "amx-packed"
    if dtype == torch.float32:
        return "transposed"
    if onednn_packing_available(dtype):
        return "onednn-packed"
    return "native-packed" if native else "torch"


def make_linear(kind: str, weight: torch.Tensor, bias: torch.Tensor | None):
    """A linear of `kind` over [out, in] `weight`; the AMX kind takes only bfloat16 weights of
    whole tiles (32 | in, 32 | out) where AMX is usable and leaves others to oneDNN's packing
    or torch."""
    weight = weight.detach().contiguous()
    if kind == "int8-packed":
        return Int8PackedLinear(weight, bias, packed_gemm.load())
    if kind == "native-packed":
        return NativePackedLinear(weight, bias, packed_gemm.load())
    if kind == "transposed":
        return TransposedLinear(weight, bias)
    amx = amx_gemm.load() if kind == "amx-packed" else None
    amx_shape = amx_gemm.AmxGemm.supports(*reversed(weight.shape))
    if amx is not None and weight.dtype == torch.bfloat16 and amx_shape:
        return AmxLinear(weight, bias, amx)
    if kind in ("amx-packed", "onednn-packed") and onednn_packing_available(weight.dtype):
        return OneDnnPackedLinear(weight, bias)
    return ReferenceLinear(weight, bias)
