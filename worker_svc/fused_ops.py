"""One-pass RMSNorm and SiLU-gated MLP product for the CPU forward (worker_svc/csrc/
fused_ops.c), swapped into the stock Hugging Face model as modules, as fast_linear does for the
linears: the decoder layer's own forward code is untouched.

In bfloat16 on a CPU with AMX, where both projections are fast_linear.AmxLinear, the gated MLP
runs gate, up and the product in one kernel pass (worker_svc/amx_gemm.py): the projections'
outputs are never written out and read back, which two oneDNN projections and a separate
product would do.

Swapped only where the math is known to be the same: the RMSNorm and MLP classes listed below
(Llama's formulas; Gemma's `1 + weight` norm, for one, is not among them), float32 or bfloat16
(rounded where torch's bfloat16 ops round), on the CPU, with the native library built with
AVX-512. `--kernels reference` keeps torch's ops.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch
from torch import nn

from worker_svc import native_attention
from worker_svc.fast_linear import AmxLinear
from worker_svc.packed_gemm import profiled_range

log = logging.getLogger("splitserve.worker.fused_ops")

_I64, _P = ctypes.c_int64, ctypes.c_void_p
RMS_NORM_CLASSES = frozenset(
    {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm"}
)
GATED_MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
# attention classes whose modeling module applies rotary in Llama's rotate-half form
ROTARY_CLASSES = frozenset(
    {"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention"}
)
SILU_CLASSES = frozenset({"SiLU", "SiLUActivation"})
DTYPES = (torch.float32, torch.bfloat16)
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


class FusedOps:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._rms_norms, self._silu_muls, self._rotaries, self._argmaxes = {}, {}, {}, {}
        self._add_rms_norms = {}
        for dtype, suffix in _SUFFIX.items():
            norm = getattr(lib, f"rms_norm_{suffix}")
            norm.argtypes = [_P, _I64, _I64, _I64, _P, ctypes.c_float, _P, _I64, _I64]
            norm.restype = ctypes.c_int
            silu_mul = getattr(lib, f"silu_mul_{suffix}")
            silu_mul.argtypes = [_P, _P, _P, _I64, _I64]
            silu_mul.restype = ctypes.c_int
            self._rms_norms[dtype], self._silu_muls[dtype] = norm, silu_mul
            add_norm = getattr(lib, f"add_rms_norm_{suffix}")
            add_norm.argtypes = [_P, _P, _I64, _I64, _I64, _I64, _P, ctypes.c_float, _P, _I64, _I64]
            add_norm.restype = ctypes.c_int
            self._add_rms_norms[dtype] = add_norm
            rotary = getattr(lib, f"rotary_{suffix}")
            rotary.argtypes = [_P, _P, *[_I64] * 7, _P, _P, _I64, _I64]
            rotary.restype = ctypes.c_int
            self._rotaries[dtype] = rotary
            argmax = getattr(lib, f"argmax_{suffix}")
            argmax.argtypes = [_P, _I64, _I64, _I64, _P, _I64]
            argmax.restype = ctypes.c_int
            self._argmaxes[dtype] = argmax

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x and weight of one dtype in DTYPES (the caller checks)."""
        dim = x.shape[-1]
        flat = x.reshape(-1, dim)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        out = torch.empty(flat.shape, dtype=x.dtype)
        with profiled_range("splitserve::rms_norm"):
            self._rms_norms[x.dtype](
                flat.data_ptr(),
                flat.shape[0],
                dim,
                flat.stride(0),
                weight.data_ptr(),
                eps,
                out.data_ptr(),
                dim,
                torch.get_num_threads(),
            )
        return out.view(x.shape)

    def add_rms_norm_(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """x += delta in place (rounded to x's dtype, as torch's add), then the RMSNorm of x:
        a decoder layer's residual add and the next norm in one pass. x [rows, dim] with
        contiguous features, delta the same shape and dtype (the caller checks)."""
        out = torch.empty(x.shape, dtype=x.dtype)
        with profiled_range("splitserve::add_rms_norm"):
            self._add_rms_norms[x.dtype](
                x.data_ptr(),
                delta.data_ptr(),
                x.shape[0],
                x.shape[1],
                x.stride(0),
                delta.stride(0),
                weight.data_ptr(),
                eps,
                out.data_ptr(),
                x.shape[1],
                torch.get_num_threads(),
            )
        return out

    def silu_mul_(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate <- silu(gate) * up (both contiguous, same shape); returns gate."""
        with profiled_range("splitserve::silu_mul"):
            self._silu_muls[gate.dtype](
                gate.data_ptr(),
                up.data_ptr(),
                gate.data_ptr(),
                gate.numel(),
                torch.get_num_threads(),
            )
        return gate

    def argmax(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Row-wise first index of the maximum of [rows, vocab] logits (float32 or bfloat16,
        CPU, unit column stride), as torch.max(dim=-1).indices; None when the kernel does not
        apply or a row holds a NaN (torch's ranking of NaN is left to torch)."""
        if (
            logits.dim() != 2
            or logits.dtype not in self._argmaxes
            or logits.device.type != "cpu"
            or logits.stride(-1) != 1
        ):
            return None
        rows, cols = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        with profiled_range("splitserve::argmax"):
            rc = self._argmaxes[logits.dtype](
                logits.data_ptr(),
                rows,
                cols,
                logits.stride(0),
                out.data_ptr(),
                torch.get_num_threads(),
            )
        return out if rc == 0 else None

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [1, heads, T, head_dim] (any strides, head_dim contiguous) rotated by cos/sin
        [1, T, head_dim]; the result laid out [T, heads, head_dim] in memory (as the
        projections' views are), in x's shape."""
        _, heads, tokens, head_dim = x.shape
        out = torch.empty((1, tokens, heads, head_dim), dtype=x.dtype).transpose(1, 2)
        with profiled_range("splitserve::rotary"):
            self._rotaries[x.dtype](
                x.data_ptr(),
                out.data_ptr(),
                tokens,
                heads,
                head_dim,
                x.stride(2),
                x.stride(1),
                out.stride(2),
                out.stride(1),
                cos.data_ptr(),
                sin.data_ptr(),
                cos.stride(1),
                torch.get_num_threads(),
            )
        return out


class NativeRotary:
    """A modeling module's `apply_rotary_pos_emb(q, k, cos, sin)` (Llama's rotate-half form),
    native for the runner's packed batch on the CPU and the stock function for anything else.
    Installed in the module (the attention forward looks the name up at each call), as the
    stock function is: float32 results are the same bits, so other users of the module in the
    process see no difference."""

    def __init__(self, stock, ops: FusedOps) -> None:
        self.stock = stock
        self._ops = ops
        self.enabled = True

    def __call__(self, q, k, cos, sin, *args, **kwargs):
        if args or kwargs or not self.enabled or not _rotary_applies(q, k, cos, sin):
            return self.stock(q, k, cos, sin, *args, **kwargs)
        return self._ops.rotary(q, cos, sin), self._ops.rotary(k, cos, sin)


def _rotary_applies(q, k, cos, sin) -> bool:
    dtype = q.dtype
    if dtype not in DTYPES or q.device.type != "cpu" or q.dim() != 4 or q.shape[0] != 1:
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return False
    tokens, head_dim = q.shape[2], q.shape[3]
    return (
        head_dim % 32 == 0
        and k.dim() == 4
        and k.shape[0] == 1
        and k.shape[2:] == q.shape[2:]
        and k.dtype == cos.dtype == sin.dtype == dtype
        and k.device.type == "cpu"
        and cos.shape == sin.shape == (1, tokens, head_dim)
        and cos.stride() == sin.stride()
        and cos.stride(-1) == q.stride(-1) == k.stride(-1) == 1
    )


def install_rotary(model: nn.Module, ops: FusedOps) -> int:
    """Put NativeRotary in the modeling modules of the model's known attention classes, where
    it gives the stock function's results on a probe (float32 bit for bit, bfloat16 as well);
    returns how many modules use it."""
    installed = 0
    for name in {type(m).__module__ for m in model.modules() if type(m).__name__ in ROTARY_CLASSES}:
        module = sys.modules.get(name)
        stock = getattr(module, "apply_rotary_pos_emb", None)
        if stock is None:
            continue
        if isinstance(stock, NativeRotary):
            stock.enabled = True
        elif _same_as_stock(NativeRotary(stock, ops), stock):
            module.apply_rotary_pos_emb = NativeRotary(stock, ops)
        else:
            log.warning("%s.apply_rotary_pos_emb differs from the native rotary: kept", name)
            continue
        installed += 1
    return installed


def _same_as_stock(native: NativeRotary, stock) -> bool:
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        qkv = torch.randn(1, 5, 3, 4, 64, generator=gen).to(dtype)  # [1, T, 3, heads, dim]
        q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
        angles = torch.randn(1, 5, 64, generator=gen) * 50
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        got, want = native(q, k, cos, sin), stock(q, k, cos, sin)
        if not all(torch.equal(g, w) for g, w in zip(got, want, strict=True)):
            return False
    return True


class NativeRMSNorm(nn.Module):
    def __init__(self, norm: nn.Module, ops: FusedOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(norm.weight.detach().contiguous(), requires_grad=False)
        self.variance_epsilon = float(norm.variance_epsilon)
        self._ops = ops

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != self.weight.dtype:  # not in the runner: HF's promotion rules
            return _stock_rms_norm(hidden_states, self.weight, self.variance_epsilon)
        return self._ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _stock_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm formula in torch ops (for inputs of another dtype than the weight)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class NativeGatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), the product in one pass, in place in gate's output."""

    def __init__(self, mlp: nn.Module, ops: FusedOps) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self._ops = ops
        # bfloat16 on AMX: both projections and the product in one kernel pass
        self._amx, self.gate_up_packed = None, None
        gate, up = self.gate_proj, self.up_proj
        if (
            isinstance(gate, AmxLinear)
            and isinstance(up, AmxLinear)
            and gate.bias is None
            and up.bias is None
            and gate.weight.shape == up.weight.shape
            and gate.out_features % 16 == 0
        ):
            packed = gate.gemm.pack_gate_up(gate.weight, up.weight)
            self.gate_up_packed = nn.Parameter(packed, requires_grad=False)
            self._amx = gate.gemm
            gate.drop_packed()
            up.drop_packed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._amx is not None and x.dtype == torch.bfloat16:
            if x.stride(-1) != 1:
                x = x.contiguous()
            product = self._amx.gate_up_silu(x, self.gate_up_packed, self.gate_proj.out_features)
            return self.down_proj(product)
        gate, up = self.gate_proj(x).contiguous(), self.up_proj(x).contiguous()
        if gate.dtype not in DTYPES or up.dtype != gate.dtype:
            return self.down_proj(nn.functional.silu(gate) * up)
        return self.down_proj(self._ops.silu_mul_(gate, up))


def load() -> FusedOps | None:
    lib = native_attention.library_with("fused_ops_available")
    return FusedOps(lib) if lib is not None and lib.fused_ops_available() else None


def fuse_elementwise(model: nn.Module) -> int:
    """Swap the known RMSNorm and SiLU-gated MLP modules (float32 or bfloat16, CPU); returns
    how many."""
    if next(model.parameters()).dtype not in DTYPES:
        return 0
    ops = load()
    if ops is None:
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            kind = type(child).__name__
            if kind in RMS_NORM_CLASSES and hasattr(child, "variance_epsilon"):
                setattr(parent, name, NativeRMSNorm(child, ops))
            elif kind in GATED_MLP_CLASSES and type(getattr(child, "act_fn", None)).__name__ in (
                SILU_CLASSES
            ):
                setattr(parent, name, NativeGatedMLP(child, ops))
            else:
                continue
            swapped += 1
    rotary = install_rotary(model, ops)
    log.info("%d norm and MLP modules now native; rotary native in %d modules", swapped, rotary)
    return swapped
