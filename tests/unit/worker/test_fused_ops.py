"""The native backend's elementwise ops (worker_svc/ops/native.py over csrc/fused_ops.c) compute
what the reference backend's compute: RMSNorm, residual add + RMSNorm, rotary, the SiLU-gated
product, argmax; each falls back to the reference op for inputs its kernel does not take."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from tests.cpu_levels import needs_level  # noqa: E402
from worker_svc import fused_ops  # noqa: E402
from worker_svc.ops import NativeOps, ReferenceOps  # noqa: E402
from worker_svc.ops.native import NativeGatedProduct  # noqa: E402

OPS = fused_ops.load()
needs_ops = needs_level("avx2", "the fused ops")
needs_amx = needs_level("amx", "the AMX gate/up kernel")
CPU = torch.device("cpu")


def backends(dtype: torch.dtype) -> tuple[NativeOps, ReferenceOps]:
    native = NativeOps(dtype)
    assert native.fused is not None  # where the level is there, the kernels must be too
    return native, ReferenceOps(CPU, dtype)


def assert_bf16_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """bfloat16 rounded where torch rounds: the same bits but for rare elements one bfloat16
    step away (the float32 sums and exp run in another order than torch's)."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    differ = got != want
    assert differ.sum().item() <= max(1, want.numel() // 10_000)
    step = want.float().abs().clamp_min(1e-30) * 2.0**-7  # one bfloat16 step
    assert bool(((got.float() - want.float()).abs() <= step)[differ].all())


@needs_ops
@pytest.mark.parametrize("dim", [576, 64, 7, 100])
@pytest.mark.parametrize("rows", [1, 3, 64, 2048])  # 2048 x 576 runs on both threads
def test_rms_norm_matches_the_reference(dim, rows):
    torch.manual_seed(dim + rows)
    native, ref = backends(torch.float32)
    weight = torch.randn(dim)
    x = torch.randn(rows, dim) * 3
    got, want = native.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@needs_ops
@pytest.mark.parametrize("dim", [576, 7, 100])
@pytest.mark.parametrize("rows", [1, 64, 2048])
def test_rms_norm_rounds_like_the_reference_in_bf16(dim, rows):
    torch.manual_seed(dim * rows)
    native, ref = backends(torch.bfloat16)
    weight = torch.randn(dim).to(torch.bfloat16)
    x = (torch.randn(rows, dim) * 3).to(torch.bfloat16)
    assert_bf16_matches(native.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5))


@needs_ops
def test_rms_norm_per_head_and_of_strided_rows():
    """Qwen3's q/k norm: [T, heads, head_dim] normed over head_dim; a strided input is copied,
    not misread."""
    native, ref = backends(torch.float32)
    weight = torch.randn(64)
    per_head = torch.randn(5, 3, 64)
    torch.testing.assert_close(
        native.rms_norm(per_head, weight, 1e-6), ref.rms_norm(per_head, weight, 1e-6)
    )
    x = torch.randn(10, 128)[:, ::2]  # every other feature
    torch.testing.assert_close(
        native.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5), atol=2e-6, rtol=1e-5
    )


@needs_ops
def test_rms_norm_of_another_dtype_than_its_weight_is_the_reference():
    native, ref = backends(torch.float32)
    weight = torch.randn(64).to(torch.bfloat16)
    x = torch.randn(3, 64)  # float32 input, bfloat16 weight: promoted to float32
    got = native.rms_norm(x, weight, 1e-5)
    assert got.dtype == torch.float32 and torch.equal(got, ref.rms_norm(x, weight, 1e-5))


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (64, 576), (3, 100), (2048, 576)])
def test_add_rms_norm_is_the_residual_add_then_the_norm(dtype, rows, dim):
    """x += delta in place, rounded as torch's add, then the same bits as the native rms_norm of
    the sum (and the reference's add + norm within its tolerance); delta may be a strided view
    (the o projection's output as it is)."""
    torch.manual_seed(rows + dim)
    native, ref = backends(dtype)
    x = torch.randn(rows, dim).to(dtype)
    wide = torch.randn(rows, dim + 32).to(dtype)
    delta = wide[:, :dim]
    weight = torch.randn(dim).to(dtype)
    want_x = x + delta
    ref_x = x.clone()
    got = native.add_rms_norm_(x, delta, weight, 1e-5)
    assert torch.equal(x, want_x) and torch.equal(got, native.rms_norm(want_x, weight, 1e-5))
    want = ref.add_rms_norm_(ref_x, delta, weight, 1e-5)
    assert torch.equal(ref_x, want_x)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


def gated_weights(dtype, hidden=64, intermediate=200):  # 200: a tail
    gen = torch.Generator().manual_seed(hidden + intermediate)
    gate = (torch.randn(intermediate, hidden, generator=gen) * 0.1).to(dtype)
    up = (torch.randn(intermediate, hidden, generator=gen) * 0.1).to(dtype)
    return gate, up


@needs_ops
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_gated_product_matches_the_reference(rows):
    torch.manual_seed(rows)
    native, ref = backends(torch.float32)
    gate, up = gated_weights(torch.float32)
    x = torch.randn(rows, 64)
    got = native.gated_product(gate, up)(x)
    want = ref.gated_product(gate, up)(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@needs_ops
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_gated_product_is_close_to_the_reference_in_bf16(rows):
    """bfloat16: the GEMMs' sums run in another order (oneDNN, AMX or the packed GEMM against
    torch's), so gate and up may differ by a bfloat16 step before the product."""
    torch.manual_seed(rows)
    native, ref = backends(torch.bfloat16)
    gate, up = gated_weights(torch.bfloat16)
    x = torch.randn(rows, 64).to(torch.bfloat16)
    got = native.gated_product(gate, up)(x)
    want = ref.gated_product(gate, up)(x)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@needs_ops
def test_silu_product_rounds_like_torch_in_bf16():
    """The SiLU product kernel itself (the gated product's second half) against torch's."""
    gen = torch.Generator().manual_seed(3)
    gate = (torch.randn(300, 200, generator=gen) * 3).to(torch.bfloat16)
    up = torch.randn(300, 200, generator=gen).to(torch.bfloat16)
    want = nn.functional.silu(gate) * up
    assert_bf16_matches(OPS.silu_mul_(gate.clone(), up), want)


@needs_ops
def test_silu_mul_over_the_float_range():
    gate = torch.tensor([-200.0, -90, -50, -1, -1e-3, 0, 1e-3, 1, 50, 90, 200] * 3)
    up = torch.linspace(-2, 2, gate.numel())
    want = nn.functional.silu(gate) * up
    got = OPS.silu_mul_(gate.clone(), up)
    torch.testing.assert_close(got, want, atol=1e-30, rtol=1e-6)


def _rotary_inputs(tokens, heads, kv_heads, head_dim, dtype, seed=0):
    """q and k as the model makes them: views of one q/k/v projection's output [T, (h + 2 kvh)
    * d], and cos/sin tables [T, d] from the reference backend."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(tokens, heads, head_dim)
    k = k.view(tokens, kv_heads, head_dim)
    inv_freq = torch.rand(head_dim // 2, generator=gen) * 3
    cos, sin = ReferenceOps(CPU, dtype).rotary_tables(torch.arange(tokens), inv_freq, 1.0)
    return q, k, cos, sin


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim"),
    [(1, 9, 3, 64), (7, 9, 3, 64), (2048, 9, 3, 64), (33, 4, 4, 128)],  # 2048: both threads
)
def test_rotary_gives_the_references_bits(dtype, tokens, heads, kv_heads, head_dim):
    native, ref = backends(dtype)
    q, k, cos, sin = _rotary_inputs(tokens, heads, kv_heads, head_dim, dtype, seed=tokens)
    for x in (q, k, q.contiguous()):  # projection views, and another layout of the same values
        got, want = native.rotary(x, cos, sin), ref.rotary(x, cos, sin)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got, want)  # bit for bit: two rounded products and a rounded sum


@needs_ops
def test_rotary_leaves_what_its_kernel_does_not_take_to_the_reference(monkeypatch):
    native, ref = backends(torch.float32)
    calls = []
    monkeypatch.setattr(native.fused, "rotary", lambda *a: calls.append(a) or None)
    for head_dim, dtype in ((48, torch.float32), (64, torch.float16)):  # 48: no 32-lane half
        native.dtype = ref.dtype = dtype
        q, _, cos, sin = _rotary_inputs(5, 4, 2, head_dim, dtype)
        assert torch.equal(native.rotary(q, cos, sin), ref.rotary(q, cos, sin))
    assert calls == []


@needs_amx
@pytest.mark.parametrize("rows", [1, 7, 64, 600])  # 600: past the linears' decode sizes
def test_gated_product_on_amx_computes_both_projections_and_the_product_in_one_pass(rows):

    torch.manual_seed(rows)
    native, ref = backends(torch.bfloat16)
    gate, up = gated_weights(torch.bfloat16, hidden=64, intermediate=192)
    fused = native.gated_product(gate, up)
    assert isinstance(fused, NativeGatedProduct) and fused.gate_up_packed is not None
    assert fused.gate.packed_weight is None and fused.up.packed_weight is None
    x = torch.randn(rows, 64).to(torch.bfloat16)
    got, want = fused(x), ref.gated_product(gate, up)(x)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # float32 sums in another order than torch's: rare one-step differences in gate or up
    # carry through the product
    close = (got.float() - want.float()).abs() <= want.float().abs() * 2.0**-6 + 2e-3
    assert close.float().mean().item() >= 0.999
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


@needs_amx
@pytest.mark.parametrize("rows", [1, 37, 64, 130, 2048])
def test_amx_gate_up_product_is_the_plain_gemm_then_the_silu_product(rows):
    """The fused kernel writes a block's rows while the tile unit multiplies the next block:
    its output is the plain AMX GEMM's gate and up (over the same pair-packed weight) put
    through silu_mul_, bit for bit, over row tails, many blocks and both threads."""
    from worker_svc import amx_gemm

    amx = amx_gemm.load()
    assert amx is not None
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
    assert torch.equal(NativeOps(dtype).argmax(logits), got)
    assert ReferenceOps(CPU, dtype).argmax(logits) is None  # the sampler's torch.max
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
