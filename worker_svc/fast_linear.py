"""Faster linear layers for the CPU forward, swapped into the stock Hugging Face model.

In float32, where the native library has its AVX-512 GEMM (worker_svc/packed_gemm.py),
`NativePackedLinear` keeps the weight only in that kernel's packed layout. Measured over the
whole model's weights (cold in cache, as in a real step), it beats MKL on the transposed weight
at every batch size: 8 rows 57 vs 37 GFLOP/s, 64 rows 213 vs 163, 2048 rows 279 vs 261.
Without it, the MKL path below.

Measured with MKL on this CPU at decode shapes (M = 64 rows): `x @ W_t`, the weight stored
transposed ([in, out], contiguous), runs 15-25 % faster than `F.linear(x, W)` ([out, in], what
nn.Linear does); a whole batch-64 decode step of SmolLM2 went from 337 to 293 ms on one thread.
(Fusing q/k/v and gate/up into one wider GEMM was measured too: slower here, 320 ms, so no.)

In bfloat16 the GEMMs go to oneDNN (AMX / AVX-512 BF16), which re-lays the weight out for its
kernel on every call; with weights cold in cache that costs a third of a decode GEMM. There,
`PackedLinear` keeps a copy packed once for decode-sized inputs (measured 171 -> 227 GFLOP/s
per core at M = 64 with cold weights, bit-identical outputs) and leaves large prefill inputs,
for which that packing is slower, to the plain weight.

Where the CPU has AMX-BF16 (worker_svc/amx_gemm.py), `AmxLinear` replaces that copy with one
packed for our own AMX kernel, which streams the weight once per call: a batch-64 decode step's
linears (SmolLM2, 30 layers) 17-21 ms against oneDNN's 21-28 ms, and ahead up to 512 rows
(67 vs 75-82 ms). Past 512 rows oneDNN's plain-weight path is faster inside a prefill step
(four W64 prefill steps, alternating: 1091-1125 ms against 1129-1190 with every projection on
AMX), though alone our kernel runs a 2048-row GEMM faster (2.7 TFLOP/s): larger inputs stay
there; the gated MLP keeps its fused kernel at every size (fused_ops.NativeGatedMLP).

`optimize_linears(model)` picks per dtype and replaces each nn.Linear; the model's forward code
is untouched. Weights are copied once at load; a tied lm_head gets its own copy.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from worker_svc import amx_gemm, packed_gemm

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
        packed = gemm.pack(linear.weight.detach().float())
        self.packed_weight = nn.Parameter(packed, requires_grad=False)
        bias = linear.bias
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        return self._gemm(x, self.packed_weight, self.out_features, self.bias)


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
    return (
        dtype in (torch.bfloat16, torch.float16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def optimize_linears(model: nn.Module) -> str:
    """Swap the model's nn.Linear modules in place (CPU); returns what they became."""
    dtype = next(model.parameters()).dtype
    gemm = packed_gemm.load() if dtype == torch.float32 else None
    amx = amx_gemm.load() if dtype == torch.bfloat16 else None
    if gemm is not None:
        make, kind = (lambda linear: NativePackedLinear(linear, gemm)), "native-packed"
    elif amx is not None:
        kind = "amx-packed"

        def make(linear: nn.Linear) -> nn.Module:
            if amx.supports(linear.in_features, linear.out_features):
                return AmxLinear(linear, amx)
            return PackedLinear(linear) if packing_available(dtype) else linear
    elif dtype == torch.float32:
        make, kind = TransposedLinear, "transposed"
    elif packing_available(dtype):
        make, kind = PackedLinear, "packed"
    else:
        return "stock"
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, make(child))
                replaced += 1
    log.info("%d linear layers now %s", replaced, kind)
    return kind
