"""The grouped low-rank product: torch's (lora_ops) against the definition, token by token, and
the native kernel (csrc/lora.c) against torch's, over random slots, ranks and rows of which some
run no adapter, float32 and bfloat16, one to three outputs (q/k/v share one input)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.cpu_levels import needs_level  # noqa: E402
from worker_svc.lora import lora_ops, native_lora  # noqa: E402
from worker_svc.lora.adapter_slots import SiteSlots  # noqa: E402
from worker_svc.lora.step_lora import StepLora  # noqa: E402

CPU = torch.device("cpu")
needs_kernel = needs_level("avx2", "the native LoRA kernel")


def random_site(seed: int, num_slots: int, max_rank: int, in_features: int, widths: list[int]):
    """Slots of random adapters, each part of a random rank (0: the adapter skips it), its rows
    past the rank zero as adapter_slots fills them."""
    gen = torch.Generator().manual_seed(seed)
    site = SiteSlots.zeros(num_slots, max_rank, [(w, in_features) for w in widths], CPU)
    for s in range(num_slots):
        for p in range(len(widths)):
            rank = int(torch.randint(0, max_rank + 1, (), generator=gen))
            rows = slice(p * max_rank, p * max_rank + rank)
            site.a[s, rows] = torch.randn(rank, in_features, generator=gen)
            site.b[p][s, :rank] = torch.randn(rank, widths[p], generator=gen)
            site.scale[s, p] = float(torch.rand((), generator=gen)) + 0.5
            site.rank[s, p] = rank
    return site


def step_of(token_slots: list[int], site: SiteSlots) -> StepLora:
    slots = np.asarray(token_slots, dtype=np.int64)
    return StepLora([{"x": site}], slots, max(int(slots.max()) + 1, 1), CPU)


def by_definition(x, outs, site, token_slots):
    """Each token alone: out_p += scale * (x A_p^T) B_p, in float64."""
    want = [o.double().clone() for o in outs]
    rank = site.max_rank
    for t, s in enumerate(token_slots):
        if s < 0:
            continue
        for p in range(len(outs)):
            a = site.a[s, p * rank : (p + 1) * rank].double()
            want[p][t] += site.scale[s, p].double() * (x[t].double() @ a.T) @ site.b[p][s].double()
    return want


def outputs(tokens: int, widths: list[int], dtype, joined: bool, seed: int):
    """Base outputs: views of one tensor's columns (q/k/v of one GEMM) or separate tensors."""
    gen = torch.Generator().manual_seed(seed)
    if joined:
        whole = torch.randn(tokens, sum(widths), generator=gen).to(dtype)
        return whole.split(widths, dim=-1)
    return tuple(torch.randn(tokens, w, generator=gen).to(dtype) for w in widths)


CASES = [  # tokens, slots, max rank, in, out widths, seed
    (7, 3, 8, 64, [64, 32, 32], 0),
    (64, 16, 16, 96, [96], 1),
    (33, 4, 4, 40, [80, 80], 2),
    (1, 1, 16, 17, [9], 3),
]


@pytest.mark.parametrize("case", CASES)
def test_torch_product_is_the_definition(case):
    tokens, num_slots, max_rank, in_features, widths, seed = case
    site = random_site(seed, num_slots, max_rank, in_features, widths)
    rng = np.random.default_rng(seed)
    token_slots = rng.integers(-1, num_slots, tokens).tolist()
    x = torch.randn(tokens, in_features, generator=torch.Generator().manual_seed(seed))
    outs = outputs(tokens, widths, torch.float32, joined=seed % 2 == 0, seed=seed)
    want = by_definition(x, outs, site, token_slots)
    lora_ops.add_lora_(x, outs, site, step_of(token_slots, site))
    for got, w in zip(outs, want, strict=True):
        torch.testing.assert_close(got.double(), w, rtol=1e-4, atol=1e-4)
    assert any(s >= 0 for s in token_slots) and any(s < 0 for s in token_slots) or tokens == 1


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("joined", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_native_kernel_matches_torch(case, dtype, joined):
    kernel = native_lora.load()
    assert kernel is not None
    tokens, num_slots, max_rank, in_features, widths, seed = case
    site = random_site(seed, num_slots, max_rank, in_features, widths)
    token_slots = np.random.default_rng(seed + 10).integers(-1, num_slots, tokens).tolist()
    x = torch.randn(tokens, in_features, generator=torch.Generator().manual_seed(seed)).to(dtype)
    want = outputs(tokens, widths, dtype, joined, seed)
    got = outputs(tokens, widths, dtype, joined, seed)
    base = [o.clone() for o in got]
    step = step_of(token_slots, site)
    assert kernel.takes(x, got)
    lora_ops.add_lora_(x, want, site, step)
    kernel.add_(x, got, site, step)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=5e-2)
    for g, w, b in zip(got, want, base, strict=True):
        torch.testing.assert_close(g.float(), w.float(), **tol)
        untouched = torch.from_numpy(np.asarray(token_slots) < 0)
        assert torch.equal(g[untouched], b[untouched])  # rows without an adapter: bit for bit


@needs_kernel
def test_native_kernel_without_adapter_rows_changes_nothing():
    site = random_site(5, 2, 4, 32, [32])
    out = (torch.randn(5, 32),)
    before = out[0].clone()
    native_lora.load().add_(torch.randn(5, 32), out, site, step_of([-1] * 5, site))
    assert torch.equal(out[0], before)
