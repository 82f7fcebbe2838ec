"""KV cache layout, sizing and swap (device <-> host block copies over all layers)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from worker_svc.kv_cache import KVCache, bytes_per_block  # noqa: E402


def make(num_blocks=8, num_host_blocks=4):
    return KVCache(
        num_layers=3,
        num_blocks=num_blocks,
        block_size=4,
        num_kv_heads=2,
        head_dim=5,
        dtype=torch.float32,
        device=torch.device("cpu"),
        num_host_blocks=num_host_blocks,
    )


def test_layout_and_size():
    kv = make()
    assert len(kv.key_caches) == len(kv.value_caches) == 3
    assert kv.key_caches[1].shape == (8, 4, 2, 5)
    assert kv.host_cache.shape == (3, 2, 4, 4, 2, 5)
    assert bytes_per_block(3, 4, 2, 5, torch.float32) == 2 * 3 * 4 * 2 * 5 * 4
    assert bytes_per_block(3, 4, 2, 5, torch.bfloat16) == 2 * 3 * 4 * 2 * 5 * 2
    # views share the one allocation; memory starts zeroed (padding reads must be finite)
    kv.key_caches[2][3].fill_(1.0)
    assert kv.device_cache[2, 0, 3].sum() == 4 * 2 * 5
    assert kv.value_caches[0].abs().sum() == 0


def test_swap_out_then_in_to_other_blocks_restores_every_layer():
    kv = make()
    original = torch.randn_like(kv.device_cache)
    kv.device_cache.copy_(original)
    kv.swap_out([(1, 3), (6, 0)])
    kv.device_cache.zero_()  # the device blocks get reused by someone else
    kv.swap_in([(4, 3), (2, 0)])
    torch.testing.assert_close(kv.device_cache[:, :, 4], original[:, :, 1])
    torch.testing.assert_close(kv.device_cache[:, :, 2], original[:, :, 6])
    assert kv.device_cache[:, :, 1].abs().sum() == 0
    for layer in range(3):
        torch.testing.assert_close(kv.key_caches[layer][4], original[layer, 0, 1])
        torch.testing.assert_close(kv.value_caches[layer][2], original[layer, 1, 6])


def test_bad_block_ids_are_rejected():
    kv = make()
    with pytest.raises(ValueError, match="device block"):
        kv.swap_out([(8, 0)])
    with pytest.raises(ValueError, match="host block"):
        kv.swap_in([(0, 4)])
    kv.swap_out([])  # nothing to do
    with pytest.raises(ValueError):
        make(num_blocks=0)
