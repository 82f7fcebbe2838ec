"""The native backend's linear kinds (worker_svc/ops/native_linear.py) compute what F.linear
computes, and each dtype gets the kind the CPU level allows."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from tests.cpu_levels import needs_level  # noqa: E402
from worker_svc import amx_gemm, cpu_caps, packed_gemm  # noqa: E402
from worker_svc.ops import native_linear  # noqa: E402
from worker_svc.ops.native_linear import (  # noqa: E402
    AMX_MAX_ROWS,
    ONEDNN_PACKED_MAX_ROWS,
    AmxLinear,
    NativePackedLinear,
    OneDnnPackedLinear,
    TransposedLinear,
    linear_kind,
    make_linear,
    onednn_packing_available,
)


def parts(lin: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    return lin.weight.detach(), None if lin.bias is None else lin.bias.detach()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_transposed_linear_matches(bias, rows):
    torch.manual_seed(0)
    lin = nn.Linear(96, 40, bias=bias)
    x = torch.randn(1, rows, 96)
    got = TransposedLinear(*parts(lin))(x)
    assert got.shape == (1, rows, 40)
    torch.testing.assert_close(got, lin(x), atol=1e-5, rtol=1e-5)


@needs_level("avx512", "oneDNN's packed bfloat16 linear")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 64, ONEDNN_PACKED_MAX_ROWS, ONEDNN_PACKED_MAX_ROWS + 1, 1000])
def test_packed_linear_is_bit_identical_in_bf16(bias, rows):
    torch.manual_seed(0)
    lin = nn.Linear(96, 40, bias=bias).to(torch.bfloat16)
    x = torch.randn(1, rows, 96).to(torch.bfloat16)
    got = OneDnnPackedLinear(*parts(lin))(x)
    assert got.shape == (1, rows, 40) and got.dtype == torch.bfloat16
    assert torch.equal(got, lin(x))


AMX = amx_gemm.load()
needs_amx = needs_level("amx")


def test_each_dtype_gets_the_kind_the_cpu_allows():
    """float32: the native packed GEMM (MKL on the transposed weight without it); bfloat16: AMX,
    else oneDNN's packed copy (AVX-512), else the packed GEMM's bfloat16 entry, else torch."""
    native = packed_gemm.load() is not None
    assert linear_kind(torch.float32) == ("native-packed" if native else "transposed")
    want = (
        "amx-packed"
        if AMX is not None
        else "onednn-packed"
        if onednn_packing_available(torch.bfloat16)
        else "native-packed"
        if native
        else "torch"
    )
    assert linear_kind(torch.bfloat16) == want
    if AMX is not None:  # 8 x 8 is no whole tile: oneDNN's packed copy
        w = torch.randn(8, 8).to(torch.bfloat16)
        assert type(make_linear("amx-packed", w, None)) is OneDnnPackedLinear
        w = torch.randn(32, 64).to(torch.bfloat16)
        assert type(make_linear("amx-packed", w, None)) is AmxLinear


KIND_LEVELS = {  # the CPU level each kind's kernel needs
    "native-packed": needs_level("avx2", "the packed GEMM"),
    "int8-packed": pytest.mark.skip(reason="int8: the quantization bound, in test_quantization"),
    "transposed": [],
    "amx-packed": needs_level("amx", "the AMX GEMM"),
    "onednn-packed": needs_level("avx512", "oneDNN's packed bfloat16 linear"),
    "torch": [],
}


@pytest.mark.parametrize(
    "kind", [pytest.param(kind, marks=marks) for kind, marks in KIND_LEVELS.items()]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kind_equals_f_linear(kind, dtype):
    """Each kind of linear (or its fallback for inputs it does not take: past its decode sizes,
    a dtype it does not pack) is F.linear to within the dtype's rounding, row counts below and
    above the packed kinds' limits."""
    assert set(KIND_LEVELS) == set(native_linear.KINDS)
    torch.manual_seed(7)
    lin = nn.Linear(96, 64).to(dtype)
    linear = make_linear(kind, *parts(lin))
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for rows in (1, 7, 300, 600):
        x = torch.randn(rows, 96).to(dtype)
        got = linear(x)
        assert got.dtype == dtype and got.shape == (rows, 64)
        want = nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float())
        torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


GEMM = packed_gemm.load()
needs_gemm = needs_level("avx2", "the packed GEMM")


@needs_gemm
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "in_features,out_features", [(96, 40), (576, 192), (7, 100), (1536, 576), (33, 49)]
)
def test_native_packed_linear_matches(bias, in_features, out_features):
    """Panel tails (out not a multiple of 48), odd K, every tile size and row blocks past 192."""
    torch.manual_seed(0)
    lin = nn.Linear(in_features, out_features, bias=bias)
    packed = NativePackedLinear(*parts(lin), GEMM)
    for rows in (1, 5, 8, 9, 64, 191, 192, 193, 500):
        x = torch.randn(1, rows, in_features)
        got = packed(x)
        assert got.shape == (1, rows, out_features)
        torch.testing.assert_close(got, lin(x), atol=2e-5 * in_features**0.5, rtol=1e-4)


@needs_gemm
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features,out_features", [(96, 40), (576, 192), (33, 49)])
def test_native_packed_linear_in_bfloat16_is_float32_math_rounded_once(
    bias, in_features, out_features
):
    """The AVX2 machine's bfloat16 path: bfloat16 in and out, float32 sums inside, so each
    output is within one bfloat16 rounding of the exact product of the bfloat16 inputs."""
    torch.manual_seed(3)
    lin = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    packed = NativePackedLinear(*parts(lin), GEMM)
    assert packed.packed_weight.dtype == torch.bfloat16
    for rows in (1, 5, 64, 193):
        x = torch.randn(1, rows, in_features).to(torch.bfloat16)
        got = packed(x)
        assert got.shape == (1, rows, out_features) and got.dtype == torch.bfloat16
        exact = nn.functional.linear(
            x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double()
        )
        # one rounding to bfloat16 (8 significant bits) plus float32 summation error
        bound = exact.abs() * 2.0**-8 + 1e-4 * in_features**0.5
        assert ((got.double() - exact).abs() <= bound).all(), rows


def test_bfloat16_linears_never_take_onednn_below_avx512(monkeypatch):
    """oneDNN's bfloat16 packing aborts on CPUs without AVX-512 (the AVX2 crash at worker
    start): capped at AVX2, bfloat16 layers go to the native GEMM (or torch)."""
    monkeypatch.setattr(
        "worker_svc.cpu_caps._probed", cpu_caps.CpuCapabilities("amx", "avx2", frozenset())
    )
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", _refuse, raising=False)
    assert not onednn_packing_available(torch.bfloat16)
    assert amx_gemm.load() is None
    kind = linear_kind(torch.bfloat16)
    assert kind == ("native-packed" if GEMM is not None else "torch")
    lin = nn.Linear(64, 32).to(torch.bfloat16)
    x = torch.randn(3, 64).to(torch.bfloat16)
    for asked in (kind, "onednn-packed", "amx-packed"):
        assert make_linear(asked, *parts(lin))(x).dtype == torch.bfloat16


def _refuse(*args, **kwargs):
    raise RuntimeError("bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl")


@needs_gemm
def test_native_packed_linear_is_batch_invariant():
    """A row's output is one fixed FMA chain: the same bits whatever it is batched with."""
    torch.manual_seed(1)
    packed = NativePackedLinear(*parts(nn.Linear(576, 1536)), GEMM)
    x = torch.randn(300, 576)
    full = packed(x)
    for start, stop in ((0, 1), (7, 8), (100, 164), (190, 300)):
        assert torch.equal(packed(x[start:stop]), full[start:stop])
    assert torch.equal(packed(x.t().contiguous().t()), full)  # a strided view is copied first


@needs_gemm
def test_native_packed_linear_threads_do_not_change_the_result():
    torch.manual_seed(2)
    packed = NativePackedLinear(*parts(nn.Linear(576, 49152 // 8)), GEMM)
    x = torch.randn(64, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = packed(x)
        torch.set_num_threads(2)
        assert torch.equal(packed(x), one)
    finally:
        torch.set_num_threads(before)


def test_without_the_native_gemm_float32_linears_run_on_mkl(monkeypatch):
    """A CPU below avx2 or a missing library: no packed GEMM, the transposed weights for MKL."""
    monkeypatch.setattr(packed_gemm, "load", lambda: None)
    assert linear_kind(torch.float32) == "transposed"


@needs_gemm
def test_packed_gemm_counts_its_own_time():
    """bench/gemm_rate.py times the linear layers by this counter rather than the profiler."""
    packed = NativePackedLinear(*parts(nn.Linear(576, 1536)), GEMM)
    x = torch.randn(64, 576)
    before = GEMM.elapsed_s()
    start = time.perf_counter()
    for _ in range(5):
        packed(x)
    wall = time.perf_counter() - start
    spent = GEMM.elapsed_s() - before
    assert 0 < spent <= wall


def assert_bf16_sums_match(got: torch.Tensor, x: torch.Tensor, lin: nn.Linear) -> None:
    """float32 sums rounded once to bfloat16: equal to the float32 reference rounded, but for
    rare elements one bfloat16 step away (the sums run in another order)."""
    want = nn.functional.linear(
        x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float()
    )
    want = want.to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    differ = got != want
    assert differ.sum().item() <= max(2, want.numel() // 2_000)
    step = want.float().abs().clamp_min(1e-3) * 2.0**-7
    assert bool(((got.float() - want.float()).abs() <= step)[differ].all())


@needs_amx
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    ("rows", "in_features", "out_features"),
    [(1, 64, 32), (7, 576, 192), (33, 576, 576), (64, 1536, 576), (100, 576, 1536), (40, 96, 4096)],
)
def test_amx_linear_matches_float32_sums_rounded(bias, rows, in_features, out_features):
    """Row tails (not a multiple of 32), every K depth, wide outputs, with and without bias."""
    torch.manual_seed(rows + in_features)
    lin = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    x = torch.randn(1, rows, in_features).to(torch.bfloat16)
    got = AmxLinear(*parts(lin), AMX)(x)
    assert got.shape == (1, rows, out_features)
    assert_bf16_sums_match(got, x, lin)
    # a strided input (every other row of a wider buffer) reads the same rows
    wide = torch.zeros(rows, 2 * in_features, dtype=torch.bfloat16)
    wide[:, :in_features] = x[0]
    assert torch.equal(AmxLinear(*parts(lin), AMX)(wide[:, :in_features]), got[0])


@needs_amx
@pytest.mark.parametrize("rows", [64, 500])
def test_amx_linear_gives_the_same_bits_on_any_number_of_threads(rows):
    """Each thread takes its own run of panel pairs and then steals from the others' (the
    worker shares its cores): more threads than cores (preempted mid-run, so runs are stolen)
    still compute every column once, in the same order."""
    torch.manual_seed(rows)
    lin = nn.Linear(576, 1536, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = AmxLinear(*parts(lin), AMX)(x)
        for threads in (2, 3, 8):
            torch.set_num_threads(threads)
            for _ in range(5):
                assert torch.equal(AmxLinear(*parts(lin), AMX)(x), one)
    finally:
        torch.set_num_threads(before)


@needs_amx
def test_amx_pack_puts_each_tile_in_vnni_order():
    weight = torch.arange(64 * 96, dtype=torch.float32).view(64, 96).to(torch.bfloat16)
    packed = AMX.pack(weight)
    assert packed.shape == (4, 3, 16, 16, 2)
    # panel 1 (columns 16..31), K slice 2 (k 64..95), pair 5, column 3, element 1: W[19][75]
    assert packed[1, 2, 5, 3, 1] == weight[19, 75]


@needs_amx
def test_amx_linear_leaves_large_inputs_to_onednn_and_is_off_below_amx(monkeypatch):
    lin = nn.Linear(64, 32).to(torch.bfloat16)
    x = torch.randn(AMX_MAX_ROWS + 1, 64).to(torch.bfloat16)
    assert torch.equal(AmxLinear(*parts(lin), AMX)(x), lin(x))
    monkeypatch.setattr(
        "worker_svc.cpu_caps._probed", cpu_caps.probe({"SPLITSERVE_CPU_LEVEL": "avx512"})
    )
    assert amx_gemm.load() is None
