"""The CPU linear replacements compute what nn.Linear computes."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from worker_svc import packed_gemm  # noqa: E402
from worker_svc.fast_linear import (  # noqa: E402
    PACKED_MAX_ROWS,
    NativePackedLinear,
    PackedLinear,
    TransposedLinear,
    optimize_linears,
    packing_available,
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_transposed_linear_matches(bias, rows):
    torch.manual_seed(0)
    lin = nn.Linear(96, 40, bias=bias)
    x = torch.randn(1, rows, 96)
    got = TransposedLinear(lin)(x)
    assert got.shape == (1, rows, 40)
    torch.testing.assert_close(got, lin(x), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not packing_available(torch.bfloat16), reason="no oneDNN bf16 packing")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 64, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1, 1000])
def test_packed_linear_is_bit_identical_in_bf16(bias, rows):
    torch.manual_seed(0)
    lin = nn.Linear(96, 40, bias=bias).to(torch.bfloat16)
    x = torch.randn(1, rows, 96).to(torch.bfloat16)
    got = PackedLinear(lin)(x)
    assert got.shape == (1, rows, 40) and got.dtype == torch.bfloat16
    assert torch.equal(got, lin(x))


def test_optimize_linears_replaces_every_linear_by_dtype():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    native = packed_gemm.load() is not None
    assert optimize_linears(model) == ("native-packed" if native else "transposed")
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Linear" not in kinds
    assert ("NativePackedLinear" if native else "TransposedLinear") in kinds
    if packing_available(torch.bfloat16):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)).to(torch.bfloat16)
        assert optimize_linears(model) == "packed"
        assert all(type(m) is not nn.Linear for m in model.modules())


GEMM = packed_gemm.load()
needs_gemm = pytest.mark.skipif(GEMM is None, reason="no AVX-512 packed GEMM on this machine")


@needs_gemm
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "in_features,out_features", [(96, 40), (576, 192), (7, 100), (1536, 576), (33, 49)]
)
def test_native_packed_linear_matches(bias, in_features, out_features):
    """Panel tails (out not a multiple of 48), odd K, every tile size and row blocks past 192."""
    torch.manual_seed(0)
    lin = nn.Linear(in_features, out_features, bias=bias)
    packed = NativePackedLinear(lin, GEMM)
    for rows in (1, 5, 8, 9, 64, 191, 192, 193, 500):
        x = torch.randn(1, rows, in_features)
        got = packed(x)
        assert got.shape == (1, rows, out_features)
        torch.testing.assert_close(got, lin(x), atol=2e-5 * in_features**0.5, rtol=1e-4)


@needs_gemm
def test_native_packed_linear_is_batch_invariant():
    """A row's output is one fixed FMA chain: the same bits whatever it is batched with."""
    torch.manual_seed(1)
    packed = NativePackedLinear(nn.Linear(576, 1536), GEMM)
    x = torch.randn(300, 576)
    full = packed(x)
    for start, stop in ((0, 1), (7, 8), (100, 164), (190, 300)):
        assert torch.equal(packed(x[start:stop]), full[start:stop])
    assert torch.equal(packed(x.t().contiguous().t()), full)  # a strided view is copied first


@needs_gemm
def test_native_packed_linear_threads_do_not_change_the_result():
    torch.manual_seed(2)
    packed = NativePackedLinear(nn.Linear(576, 49152 // 8), GEMM)
    x = torch.randn(64, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = packed(x)
        torch.set_num_threads(2)
        assert torch.equal(packed(x), one)
    finally:
        torch.set_num_threads(before)


def test_native_gemm_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_NATIVE_GEMM", "0")
    assert packed_gemm.load() is None
    model = nn.Sequential(nn.Linear(8, 8))
    assert optimize_linears(model) == "transposed"


@needs_gemm
def test_packed_gemm_counts_its_own_time():
    """bench/gemm_rate.py times the linear layers by this counter rather than the profiler."""
    packed = NativePackedLinear(nn.Linear(576, 1536), GEMM)
    x = torch.randn(64, 576)
    before = GEMM.elapsed_s()
    start = time.perf_counter()
    for _ in range(5):
        packed(x)
    wall = time.perf_counter() - start
    spent = GEMM.elapsed_s() - before
    assert 0 < spent <= wall
