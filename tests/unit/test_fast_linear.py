"""The CPU linear replacements compute what nn.Linear computes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from worker_svc.fast_linear import (  # noqa: E402
    PACKED_MAX_ROWS,
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
    assert optimize_linears(model) == "transposed"
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Linear" not in kinds and "TransposedLinear" in kinds
    if packing_available(torch.bfloat16):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)).to(torch.bfloat16)
        assert optimize_linears(model) == "packed"
        assert all(type(m) is not nn.Linear for m in model.modules())
