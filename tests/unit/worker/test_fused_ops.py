"""The native RMSNorm and SiLU-gated MLP product compute what Hugging Face's modules compute,
and are swapped in only where that is known to hold."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm  # noqa: E402

from tests.cpu_levels import needs_level  # noqa: E402
from worker_svc import fused_ops  # noqa: E402

OPS = fused_ops.load()
needs_ops = needs_level("avx512", "the fused ops")


@needs_ops
@pytest.mark.parametrize("dim", [576, 64, 7, 100])
@pytest.mark.parametrize("rows", [1, 3, 64, 2048])  # 2048 x 576 runs on both threads
def test_rms_norm_matches_llama(dim, rows):
    torch.manual_seed(dim + rows)
    norm = LlamaRMSNorm(dim, eps=1e-5)
    norm.weight.data.normal_()
    x = torch.randn(1, rows, dim) * 3
    torch.testing.assert_close(fused_ops.NativeRMSNorm(norm, OPS)(x), norm(x), atol=2e-6, rtol=1e-5)


def assert_bf16_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """bfloat16 rounded where torch rounds: the same bits but for rare elements one bfloat16
    step away (the float32 sums and exp run in another order than torch's)."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    differ = got != want
    assert differ.sum().item() <= max(1, want.numel() // 10_000)
    step = want.float().abs().clamp_min(1e-30) * 2.0**-7  # one bfloat16 step
    assert bool(((got.float() - want.float()).abs() <= step)[differ].all())


@needs_ops
@pytest.mark.parametrize("dim", [576, 7, 100])
@pytest.mark.parametrize("rows", [1, 64, 2048])
def test_rms_norm_rounds_like_torch_in_bf16(dim, rows):
    torch.manual_seed(dim * rows)
    norm = LlamaRMSNorm(dim, eps=1e-5)
    norm.weight.data.normal_()
    norm = norm.to(torch.bfloat16)
    x = (torch.randn(1, rows, dim) * 3).to(torch.bfloat16)
    assert_bf16_matches(fused_ops.NativeRMSNorm(norm, OPS)(x), norm(x))


@needs_ops
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_gated_mlp_rounds_like_torch_in_bf16(rows):
    torch.manual_seed(rows)
    mlp = LlamaMLP(transformers.LlamaConfig(hidden_size=64, intermediate_size=200))
    mlp = mlp.to(torch.bfloat16)
    x = torch.randn(1, rows, 64).to(torch.bfloat16)
    assert_bf16_matches(fused_ops.NativeGatedMLP(mlp, OPS)(x), mlp(x))


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (64, 576), (3, 100), (2048, 576)])
def test_add_rms_norm_is_the_residual_add_then_the_norm(dtype, rows, dim):
    """x += delta in place, rounded as torch's add, then the same bits as rms_norm of the sum;
    delta may be a strided view (the runner passes projection outputs as they are)."""
    torch.manual_seed(rows + dim)
    x = torch.randn(rows, dim).to(dtype)
    wide = torch.randn(rows, dim + 32).to(dtype)
    delta = wide[:, :dim]
    weight = torch.randn(dim).to(dtype)
    want_x = x + delta
    want = OPS.rms_norm(want_x, weight, 1e-5)
    got = OPS.add_rms_norm_(x, delta, weight, 1e-5)
    assert torch.equal(x, want_x) and torch.equal(got, want)


@needs_ops
def test_rms_norm_of_another_dtype_than_its_weight_follows_hf():
    norm = LlamaRMSNorm(64).to(torch.bfloat16)
    x = torch.randn(3, 64)  # float32 input, bfloat16 weight: HF promotes to float32
    got = fused_ops.NativeRMSNorm(norm, OPS)(x)
    assert got.dtype == torch.float32 and torch.equal(got, norm(x))


@needs_ops
def test_rms_norm_reads_strided_rows():
    norm = LlamaRMSNorm(64)
    x = torch.randn(10, 128)[:, ::2]  # every other feature: copied, not misread
    torch.testing.assert_close(fused_ops.NativeRMSNorm(norm, OPS)(x), norm(x), atol=2e-6, rtol=1e-5)


@needs_ops
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_gated_mlp_matches_llama(rows):
    torch.manual_seed(rows)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=200)  # 200: a tail
    mlp = LlamaMLP(config)
    x = torch.randn(1, rows, 64)
    want = mlp(x)
    torch.testing.assert_close(fused_ops.NativeGatedMLP(mlp, OPS)(x), want, atol=1e-5, rtol=1e-4)


@needs_ops
def test_silu_mul_over_the_float_range():
    gate = torch.tensor([-200.0, -90, -50, -1, -1e-3, 0, 1e-3, 1, 50, 90, 200] * 3)
    up = torch.linspace(-2, 2, gate.numel())
    want = nn.functional.silu(gate) * up
    got = OPS.silu_mul_(gate.clone(), up)
    torch.testing.assert_close(got, want, atol=1e-30, rtol=1e-6)


def _tiny_llama(dtype=torch.float32):
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fuse_swaps_every_norm_and_mlp_and_keeps_the_logits(dtype):
    model = _tiny_llama(dtype)
    reference = copy.deepcopy(model)
    assert fused_ops.fuse_elementwise(model) == 2 * 2 + 1 + 2  # 2 norms a layer, final, MLPs
    kinds = {type(m).__name__ for m in model.modules()}
    assert "LlamaRMSNorm" not in kinds and "LlamaMLP" not in kinds
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


def test_fuse_leaves_other_formulas_dtypes_and_no_library_alone(monkeypatch):
    class GemmaRMSNorm(nn.Module):  # x * (1 + weight): not Llama's formula
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(8))
            self.variance_epsilon = 1e-6

    model = nn.Sequential(GemmaRMSNorm(), nn.Linear(8, 8))
    assert fused_ops.fuse_elementwise(model) == 0
    assert fused_ops.fuse_elementwise(_tiny_llama(torch.float16)) == 0
    monkeypatch.setattr(fused_ops, "load", lambda: None)  # no native library
    assert fused_ops.fuse_elementwise(_tiny_llama()) == 0


def _stock_rotary():
    from transformers.models.llama import modeling_llama

    current = modeling_llama.apply_rotary_pos_emb
    return current.stock if isinstance(current, fused_ops.NativeRotary) else current


def _rotary_inputs(tokens, heads, kv_heads, head_dim, dtype, seed=0):
    """q and k as the attention forward makes them: views of the projections [1, T, h * d]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, tokens, heads * head_dim, generator=gen).to(dtype)
    k = torch.randn(1, tokens, kv_heads * head_dim, generator=gen).to(dtype)
    q = q.view(1, tokens, heads, head_dim).transpose(1, 2)
    k = k.view(1, tokens, kv_heads, head_dim).transpose(1, 2)
    angles = torch.arange(tokens)[None, :, None] * torch.rand(1, 1, head_dim, generator=gen) * 3
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim"),
    [(1, 9, 3, 64), (7, 9, 3, 64), (2048, 9, 3, 64), (33, 4, 4, 128)],  # 2048: both threads
)
def test_rotary_gives_the_stock_functions_bits(dtype, tokens, heads, kv_heads, head_dim):
    stock = _stock_rotary()
    q, k, cos, sin = _rotary_inputs(tokens, heads, kv_heads, head_dim, dtype, seed=tokens)
    got = fused_ops.NativeRotary(stock, OPS)(q, k, cos, sin)
    want = stock(q, k, cos, sin)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g, w)  # bit for bit: two rounded products and a rounded sum
    q_contig = q.contiguous()  # another layout of the same values
    assert torch.equal(fused_ops.NativeRotary(stock, OPS)(q_contig, k, cos, sin)[0], want[0])


@needs_ops
def test_rotary_hands_what_it_does_not_cover_to_the_stock_function():
    calls = []

    def stock(*args, **kwargs):
        calls.append(kwargs)
        return _stock_rotary()(*args, **kwargs)

    native = fused_ops.NativeRotary(stock, OPS)
    q, k, cos, sin = _rotary_inputs(5, 4, 2, 64, torch.float32)
    native(q, k, cos, sin)
    assert calls == []
    native(q, k, cos, sin, unsqueeze_dim=1)  # another call form
    native(*_rotary_inputs(5, 4, 2, 48, torch.float32))  # head_dim 48: half not 16-lane wide
    native(*_rotary_inputs(5, 4, 2, 64, torch.float16))
    native(q.detach().requires_grad_(), k, cos, sin)  # autograd needs torch's ops
    native.enabled = False
    native(q, k, cos, sin)
    assert len(calls) == 5


@needs_ops
def test_rotary_is_installed_only_where_the_module_computes_the_same(monkeypatch):
    import sys
    import types

    model = _tiny_llama()
    reference = copy.deepcopy(model)
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", _stock_rotary())
    assert fused_ops.install_rotary(model, OPS) == 1
    assert isinstance(modeling_llama.apply_rotary_pos_emb, fused_ops.NativeRotary)
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)

    def partial_rotary(q, k, cos, sin, unsqueeze_dim=1):  # rotates only half of each head
        half = q.shape[-1] // 2
        rotated = _stock_rotary()(q[..., :half], k[..., :half], cos[..., :half], sin[..., :half])
        return (
            torch.cat([rotated[0], q[..., half:]], -1),
            torch.cat([rotated[1], k[..., half:]], -1),
        )

    other = types.ModuleType("fake_modeling")
    other.apply_rotary_pos_emb = partial_rotary
    other.LlamaAttention = type("LlamaAttention", (nn.Module,), {"__module__": "fake_modeling"})
    monkeypatch.setitem(sys.modules, "fake_modeling", other)
    assert fused_ops.install_rotary(nn.Sequential(other.LlamaAttention()), OPS) == 0
    assert other.apply_rotary_pos_emb is partial_rotary


@needs_ops
@pytest.mark.parametrize("rows", [1, 7, 64, 600])  # 600: past the linears' decode sizes
def test_gated_mlp_on_amx_computes_both_projections_and_the_product_in_one_pass(rows):
    from worker_svc import amx_gemm
    from worker_svc.fast_linear import optimize_linears

    if amx_gemm.load() is None:
        pytest.skip("no AMX-BF16 on this machine")
    torch.manual_seed(rows)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=192)
    mlp = LlamaMLP(config).to(torch.bfloat16)
    reference = copy.deepcopy(mlp)
    holder = nn.Sequential(mlp)
    optimize_linears(holder)
    fused = fused_ops.NativeGatedMLP(holder[0], OPS)
    assert fused.gate_up_packed is not None
    assert fused.gate_proj.packed_weight is None and fused.up_proj.packed_weight is None
    x = torch.randn(1, rows, 64).to(torch.bfloat16)
    got, want = fused(x), reference(x)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # float32 sums in another order than oneDNN's: rare one-step differences in gate or up
    # carry through the product and the down projection
    close = (got.float() - want.float()).abs() <= want.float().abs() * 2.0**-6 + 2e-3
    assert close.float().mean().item() >= 0.999
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


@needs_ops
@pytest.mark.parametrize("rows", [1, 37, 64, 130, 2048])
def test_amx_gate_up_product_is_the_plain_gemm_then_the_silu_product(rows):
    """The fused kernel writes a block's rows while the tile unit multiplies the next block:
    its output is the plain AMX GEMM's gate and up (over the same pair-packed weight) put
    through silu_mul_, bit for bit, over row tails, many blocks and both threads."""
    from worker_svc import amx_gemm

    amx = amx_gemm.load()
    if amx is None:
        pytest.skip("no AMX-BF16 on this machine")
    gen = torch.Generator().manual_seed(rows)
    hidden, inter = 576, 1536
    gate, up = (
        (torch.randn(inter, hidden, generator=gen) * 0.05).to(torch.bfloat16) for _ in range(2)
    )
    packed = amx.pack_gate_up(gate, up)
    x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
    pairs = amx(x, packed, 2 * inter, None).view(rows, inter // 16, 2, 16)
    want = OPS.silu_mul_(pairs[:, :, 0].reshape(rows, inter), pairs[:, :, 1].reshape(rows, inter))
    assert torch.equal(amx.gate_up_silu(x, packed, inter), want)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "cols"), [(1, 7), (3, 49152), (64, 49152), (5, 100)])
def test_argmax_is_torchs_first_maximum(dtype, rows, cols):
    gen = torch.Generator().manual_seed(rows * cols)
    logits = (torch.randn(rows, cols + 3, generator=gen) * 4).to(dtype)[:, :cols]  # strided rows
    logits[0, cols // 2] = logits[0, cols - 1] = 1e4  # a tie: the first one wins
    if rows > 1:
        logits[-1, :] = float("-inf")
        logits[-1, cols - 1] = -3.0  # the only finite value, in the tail
    got = OPS.argmax(logits)
    assert got is not None and torch.equal(got, torch.max(logits, dim=-1).indices)
    assert got[0] == cols // 2 and (rows == 1 or got[-1] == cols - 1)


@needs_ops
def test_argmax_leaves_nan_and_other_layouts_to_torch():
    logits = torch.randn(4, 300)
    logits[2, 7] = float("nan")
    assert OPS.argmax(logits) is None
    assert OPS.argmax(torch.randn(300, 4).t()) is None  # columns not contiguous
    assert OPS.argmax(torch.randn(2, 3, 5)) is None
    assert OPS.argmax(torch.randn(2, 5).half()) is None


@needs_ops
def test_sampler_fast_greedy_path_gives_the_same_tokens():
    from worker_svc.sampler import Sampler, SamplingMetadata

    logits = (torch.randn(8, 1000) * 3).to(torch.bfloat16)
    meta = SamplingMetadata(num_rows=8)
    assert meta.all_greedy
    plain = Sampler(torch.Generator())(logits, meta).token_ids
    fast = Sampler(torch.Generator(), OPS.argmax)(logits, meta).token_ids
    assert torch.equal(plain, fast)
