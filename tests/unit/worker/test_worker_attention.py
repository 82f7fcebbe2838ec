"""Paged attention equals plain causal attention per request, for a mixed packed batch."""

from __future__ import annotations

import math
import random
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.cpu_levels import needs_level  # noqa: E402
from worker_svc import cpu_caps, kernel_build, native_attention  # noqa: E402
from worker_svc.attention import build_metadata, paged_attention  # noqa: E402

NATIVE = native_attention.load()
BACKENDS = [
    "torch",
    pytest.param("native", marks=pytest.mark.skipif(NATIVE is None, reason="no C compiler")),
]

H, KVH, D, BS, NUM_BLOCKS = 4, 2, 8, 4, 64


def reference(q, k, v, offset):
    """q [n, heads, d] at positions offset.., k/v [offset + n, kv_heads, d]: causal GQA
    attention, in float32."""
    q, k, v = q.float(), k.float(), v.float()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    n, total = q.shape[0], k.shape[0]
    allowed = torch.arange(total)[None, :] <= (offset + torch.arange(n))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("group_size", [1, 2, 8])
def test_mixed_batch_matches_reference(group_size, backend):
    check_mixed_batch(group_size, backend, H, KVH, D)


@needs_level("avx512", "the native paged prefill")
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 48)])
def test_mixed_batch_with_native_prefill_matches_reference(heads, kv_heads, head_dim):
    cache = torch.zeros(1, 1, kv_heads, head_dim)
    assert NATIVE.supports_prefill(cache, heads, kv_heads, head_dim)
    check_mixed_batch(1, "native-prefill", heads, kv_heads, head_dim)


def check_mixed_batch(group_size, backend, H, KVH, D):  # noqa: N803 - the module's names
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    # (tokens already cached, tokens this step): decodes of various lengths, fresh and
    # offset prefill chunks, and a one-token prompt
    reqs = [(5, 1), (12, 1), (0, 1), (3, 1), (16, 1), (0, 7), (6, 5), (8, 4)]
    key_cache = torch.zeros(NUM_BLOCKS, BS, KVH, D)
    value_cache = torch.zeros(NUM_BLOCKS, BS, KVH, D)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    data = []
    for c, n in reqs:
        total = c + n
        blocks = [free.pop() for _ in range(-(-total // BS))]
        k = torch.randn(total, KVH, D, generator=gen)
        v = torch.randn(total, KVH, D, generator=gen)
        q = torch.randn(n, H, D, generator=gen)
        for pos in range(c):  # the context is already in the cache
            key_cache[blocks[pos // BS], pos % BS] = k[pos]
            value_cache[blocks[pos // BS], pos % BS] = v[pos]
        data.append(SimpleNamespace(c=c, n=n, blocks=blocks, k=k, v=v, q=q))
    decodes = sorted((d for d in data if d.n == 1), key=lambda d: d.c)
    packed = decodes + [d for d in data if d.n != 1]
    width = max(len(d.blocks) for d in packed)
    table = np.zeros((len(packed), width), dtype=np.int64)
    slots = []
    for i, d in enumerate(packed):
        table[i, : len(d.blocks)] = d.blocks
        slots += [d.blocks[p // BS] * BS + p % BS for p in range(d.c, d.c + d.n)]
    meta = build_metadata(
        key_caches=[key_cache],
        value_caches=[value_cache],
        block_size=BS,
        block_table=table,
        num_computed=np.array([d.c for d in packed]),
        num_scheduled=np.array([d.n for d in packed]),
        num_decodes=len(decodes),
        decode_group_size=group_size,
        slot_mapping=torch.tensor(slots),
        dtype=torch.float32,
        device=torch.device("cpu"),
        decode_kernel=NATIVE if backend.startswith("native") else None,
        native_prefill=backend == "native-prefill",
    )
    assert meta.num_native_decodes == (len(decodes) if backend.startswith("native") else 0)
    assert (meta.prefill_q_len is not None) == (backend == "native-prefill")
    query = torch.cat([d.q for d in packed])  # [T, H, D]
    key = torch.cat([d.k[d.c :] for d in packed])  # [T, KVH, D]
    value = torch.cat([d.v[d.c :] for d in packed])
    flat = paged_attention(query, key, value, key_cache, value_cache, meta, D**-0.5)
    total = sum(d.n for d in packed)
    assert flat.shape == (total, H * D)
    out = flat.view(1, total, H, D)
    start = 0
    for d in packed:
        want = reference(d.q, d.k, d.v, d.c)
        torch.testing.assert_close(out[0, start : start + d.n], want, atol=1e-5, rtol=1e-4)
        start += d.n
        for pos in range(d.c + d.n):  # every token's K/V now sits in its slot
            torch.testing.assert_close(key_cache[d.blocks[pos // BS], pos % BS], d.k[pos])
            torch.testing.assert_close(value_cache[d.blocks[pos // BS], pos % BS], d.v[pos])


@pytest.mark.skipif(NATIVE is None, reason="no C compiler")
@pytest.mark.parametrize(
    ("dtype", "bf16_dot"),
    [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)],
)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),  # groups of 3, 4 and 2 have their own bfloat16 bodies
    [(9, 3, 64), (8, 2, 64), (4, 2, 128), (8, 8, 128), (6, 2, 24), (16, 2, 64)],
)
@pytest.mark.parametrize(("bs", "q_scale"), [(16, 1.0), (8, 1.0), (32, 6.0), (3, 6.0)])
def test_native_decode_kernel_matches_sdpa(dtype, bf16_dot, heads, kv_heads, head_dim, bs, q_scale):
    """The C kernel (vectorised for head_dim % 16 == 0, plain loop otherwise) against SDPA on
    the gathered context, rows of very different lengths (odd ones too: the AVX512-BF16 bodies
    sum V two tokens at a time) over scattered blocks; blocks smaller and larger than the
    kernel's 16-token chunks, and sharp score distributions (q_scale) whose running max moves
    from chunk to chunk (the vector path's softmax is online). The AVX512-BF16 bodies round P
    to bfloat16 before P.V, as torch's bfloat16 attention does: their error is held to the
    size of the bfloat16 rounding of the output itself (which the runner applies next). They
    run in two passes (scores, one softmax per head, V); blocks of 3 tokens put pairs of V rows
    across block boundaries."""
    if bf16_dot and not NATIVE.set_bf16_dot(True):
        pytest.skip("no AVX512-BF16 on this CPU")
    with kernel_bodies(bf16_dot=bf16_dot):
        check_decode_kernel(dtype, bf16_dot, heads, kv_heads, head_dim, bs, q_scale)


@contextmanager
def kernel_bodies(**switches: bool):
    """NATIVE's optional bodies (bf16_dot, amx_prefill) set for the block, then put back."""
    setters = {"bf16_dot": NATIVE.set_bf16_dot, "amx_prefill": NATIVE.set_amx_prefill}
    was = {name: getattr(NATIVE, name) for name in switches}
    for name, on in switches.items():
        setters[name](on)
    try:
        yield
    finally:
        for name, on in was.items():
            setters[name](on)


def check_decode_kernel(dtype, bf16_dot, heads, kv_heads, head_dim, bs, q_scale):
    gen = torch.Generator().manual_seed(1)
    num_blocks = 300 * 16 // bs
    k_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor([1, 15, 16, 17, 130, 400, 3])
    width = -(-int(lens.max()) // bs)
    table = torch.randperm(num_blocks, generator=gen)[: len(lens) * width].view(len(lens), width)
    # the runner's queries come from the model's dtype
    q = (torch.randn(len(lens), heads, head_dim, generator=gen) * q_scale).to(dtype).float()
    scale = head_dim**-0.5
    out = NATIVE(q, k_cache, v_cache, table, lens, int(lens.max()), scale)
    for r, n in enumerate(lens.tolist()):
        k = k_cache[table[r]].flatten(0, 1)[:n].float().transpose(0, 1)  # [kvh, n, d]
        v = v_cache[table[r]].flatten(0, 1)[:n].float().transpose(0, 1)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[r][:, None], k, v, scale=scale, enable_gqa=True
        )[:, 0]
        if bf16_dot:
            assert_within_bf16_rounding(out[r], want, (r, n))
        else:
            torch.testing.assert_close(out[r], want, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(NATIVE is None, reason="no C compiler")
@pytest.mark.parametrize(
    ("dtype", "amx"), [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 8, 128), (8, 1, 48), (8, 1, 64)]
)
@pytest.mark.parametrize(("bs", "q_scale"), [(16, 1.0), (8, 1.0), (32, 6.0)])
def test_native_prefill_kernel_matches_reference(
    dtype, amx, heads, kv_heads, head_dim, bs, q_scale
):
    """Chunks of every size around the kernel's 16-key slices (32 on AMX) and 32-query tiles,
    fresh and after cached tokens, over scattered blocks; sharp scores (q_scale) move the
    running max (the softmax rescales lazily) from slice to slice. The AMX bodies (bfloat16,
    head_dim 64) round P to bfloat16 before P.V, as torch's bfloat16 attention does: their
    error is held to the size of the output's own bfloat16 rounding."""
    if not NATIVE.supports_prefill(
        torch.zeros(1, 1, 1, 16, dtype=dtype), heads, kv_heads, head_dim
    ):
        pytest.skip("no AVX-512 prefill kernel here")
    if amx and not NATIVE.set_amx_prefill(True):
        pytest.skip("no AMX on this CPU")
    with kernel_bodies(amx_prefill=amx):
        check_prefill_kernel(dtype, amx and head_dim == 64, heads, kv_heads, head_dim, bs, q_scale)


def check_prefill_kernel(dtype, rounds_p, heads, kv_heads, head_dim, bs, q_scale):
    gen = torch.Generator().manual_seed(2)
    chunks = [(0, 1), (0, 31), (0, 33), (5, 1), (17, 40), (0, 300), (100, 64), (3, 16)]
    width = max(-(-(c + n) // bs) for c, n in chunks)
    num_blocks = len(chunks) * width + 8
    k_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[: len(chunks) * width].view(
        len(chunks), width
    )
    for r, (c, n) in enumerate(chunks):  # slots past a chunk may hold anything: NaN here
        last, used = table[r, (c + n - 1) // bs], (c + n - 1) % bs + 1
        k_cache[last, used:] = float("nan")
        v_cache[last, used:] = float("nan")
    lens = torch.tensor([n for _, n in chunks])
    cached = torch.tensor([c for c, _ in chunks])
    # the runner's queries come from the model's dtype
    q = (torch.randn(int(lens.sum()), heads, head_dim, generator=gen) * q_scale).to(dtype).float()
    starts = torch.cumsum(lens, 0) - lens
    out = NATIVE.prefill(q, k_cache, v_cache, table, starts, lens, cached, head_dim**-0.5)
    for r, (c, n) in enumerate(chunks):
        k = k_cache[table[r]].flatten(0, 1)[: c + n]
        v = v_cache[table[r]].flatten(0, 1)[: c + n]
        want = reference(q[starts[r] : starts[r] + n], k, v, c)
        got = out[starts[r] : starts[r] + n]
        if rounds_p:
            assert_within_bf16_rounding(got, want, (r, c, n))
        else:
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def assert_within_bf16_rounding(got: torch.Tensor, want: torch.Tensor, where) -> None:
    """got's error against want no larger (mean: twice) than want's own bfloat16 rounding."""
    output_rounding = (want.to(torch.bfloat16).float() - want).abs()
    error = (got - want).abs()
    assert error.mean() <= 2 * output_rounding.mean() + 1e-6, (where, error.mean())
    assert error.max() < 2 * output_rounding.max() + 1e-3, (where, error.max())


@pytest.mark.skipif(NATIVE is None, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_native_write_kv_matches_index_copy(dtype, transposed):
    gen = torch.Generator().manual_seed(2)
    blocks, bs, kvh, d, tokens = 100, 4, 3, 16, 300  # > 256 token-heads: the threaded loop
    slots = torch.randperm(blocks * bs, generator=gen)[:tokens]
    if transposed:  # [1, T, kvh, d] viewed as [1, kvh, T, d], as HF's projections produce
        key = torch.randn(1, tokens, kvh, d, generator=gen).to(dtype).transpose(1, 2)
    else:
        key = torch.randn(1, kvh, tokens, d, generator=gen).to(dtype)
    value = torch.randn(1, tokens, kvh, d, generator=gen).to(dtype).transpose(1, 2)
    caches = [torch.zeros(blocks, bs, kvh, d, dtype=dtype) for _ in range(4)]
    NATIVE.write_kv(key[0], value[0], caches[0], caches[1], slots)
    caches[2].view(-1, kvh, d).index_copy_(0, slots, key[0].transpose(0, 1))
    caches[3].view(-1, kvh, d).index_copy_(0, slots, value[0].transpose(0, 1))
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_native_kernel_build_cache_and_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SPLITSERVE_PREBUILT_KERNELS", str(tmp_path / "none-prebuilt"))
    monkeypatch.setattr(native_attention, "_tried", False)
    monkeypatch.setattr(native_attention, "_loaded", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert native_attention.load() is None  # no library in the cache, no compiler
    if NATIVE is None:
        return
    monkeypatch.delenv("CC")
    built = kernel_build.native_build(tmp_path / "kernels")
    assert built.parent == tmp_path / "kernels" and built.exists()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert kernel_build.native_build(tmp_path / "kernels") == built  # reused, no compiler needed


def test_prebuilt_choice_follows_the_cpu_level(tmp_path):
    for level in kernel_build.PORTABLE_LEVELS:
        (tmp_path / kernel_build.prebuilt_name(level)).touch()
    older = f"{kernel_build.LIBRARY_PREFIX}-avx512-0000000000000000.so"  # other sources'
    (tmp_path / older).touch()

    def caps(cpu_level: str, level: str | None = None) -> cpu_caps.CpuCapabilities:
        return cpu_caps.CpuCapabilities(cpu_level, level or cpu_level, frozenset())

    for level, want in [("amx", "avx512"), ("avx512-bf16", "avx512"), ("avx2", "avx2")]:
        found = kernel_build.find_prebuilt(tmp_path, caps(level))
        assert found is not None and found.name == kernel_build.prebuilt_name(want), level
    capped = kernel_build.find_prebuilt(tmp_path, caps("amx", "avx2"))  # SPLITSERVE_CPU_LEVEL
    assert capped is not None and capped.name == kernel_build.prebuilt_name("avx2")
    assert kernel_build.find_prebuilt(tmp_path, caps("none")) is None


@pytest.mark.skipif(NATIVE is None, reason="no C compiler")
def test_worker_without_compiler_loads_a_prebuilt_kernel(tmp_path, monkeypatch):
    """The worker image's case: no compiler, an empty cache, portable libraries shipped in the
    package. The one this CPU can run is loaded and computes what the native build does."""
    prebuilt = kernel_build.prebuild(tmp_path / "prebuilt")
    assert len(prebuilt) == len(kernel_build.PORTABLE_LEVELS)
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("SPLITSERVE_PREBUILT_KERNELS", str(tmp_path / "prebuilt"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(native_attention, "_tried", False)
    monkeypatch.setattr(native_attention, "_loaded", None)
    kernel = native_attention.load()
    assert kernel is not None and kernel.path in prebuilt
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = (torch.randn(40, 16, 3, 64, generator=gen) for _ in range(2))
    table = torch.randperm(40, generator=gen)[:30].view(3, 10)
    lens = torch.tensor([1, 77, 160])
    q = torch.randn(3, 9, 64, generator=gen)
    got = kernel(q, k_cache, v_cache, table, lens, 160, 0.125)
    want = NATIVE(q, k_cache, v_cache, table, lens, 160, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(NATIVE is None, reason="no C compiler")
def test_loading_the_kernel_keeps_subnormal_floats():
    """A library built with -ffast-math would switch the whole process to flush-to-zero on
    load (crtfastmath.o): model numerics and unrelated code would change under the worker."""
    tiny = float("5e-324")  # the smallest subnormal double
    assert native_attention.load() is not None
    assert tiny * 1.0 == tiny
    assert torch.tensor([1e-40], dtype=torch.float32).mul(1.0).item() > 0


@pytest.mark.skipif(NATIVE is None, reason="no C compiler")
@pytest.mark.parametrize("fast_bodies", [True, False])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 128), (6, 2, 24)])
def test_bfloat16_queries_go_in_and_come_out_as_bfloat16(fast_bodies, heads, kv_heads, head_dim):
    """bfloat16 q straight into the kernels (the AVX512-BF16 decode and AMX prefill bodies read
    and write bfloat16; anything else converts around the call): the same bits as float32 q
    with the result rounded to bfloat16 after, on every path."""
    gen = torch.Generator().manual_seed(5)
    bs, num_blocks = 16, 64
    k_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen).bfloat16()
    table = torch.randperm(num_blocks, generator=gen)[:60].view(3, 20)
    lens = torch.tensor([1, 77, 300])
    scale = head_dim**-0.5
    with kernel_bodies(bf16_dot=fast_bodies, amx_prefill=fast_bodies):
        q = torch.randn(3, heads, head_dim, generator=gen).bfloat16()
        got = NATIVE(q, k_cache, v_cache, table, lens, int(lens.max()), scale)
        want = NATIVE(q.float(), k_cache, v_cache, table, lens, int(lens.max()), scale)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())
        if NATIVE.supports_prefill(k_cache, heads, kv_heads, head_dim):
            cached = torch.tensor([0, 40, 250])
            q_len = lens - cached
            starts = torch.cumsum(q_len, 0) - q_len
            q = torch.randn(int(q_len.sum()), heads, head_dim, generator=gen).bfloat16()
            got = NATIVE.prefill(q, k_cache, v_cache, table, starts, q_len, cached, scale)
            want = NATIVE.prefill(q.float(), k_cache, v_cache, table, starts, q_len, cached, scale)
            assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())
