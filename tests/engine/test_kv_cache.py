"""Slot KV cache: writes land in the right slot/position, rollback is a length change."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import KVCache, SlotCaches


def _cache() -> KVCache:
    return KVCache(num_layers=2, num_slots=3, num_kv_heads=2, capacity=8, head_dim=4)


def test_write_then_read_per_slot_and_position() -> None:
    cache = _cache()
    k = torch.arange(2 * 2 * 3 * 4, dtype=torch.float32).view(2, 2, 3, 4)  # [b, h, t, d]
    v = -k
    slots = torch.tensor([2, 0])
    positions = torch.tensor([[0, 1, 2], [5, 6, 7]])
    valid = torch.tensor([[True, True, False], [True, True, True]])
    cache.write(1, slots, positions, valid, k, v)
    rk, rv = cache.read(1, torch.tensor([2, 0]), 8)  # [2, h, 8, d]
    assert torch.equal(rk[0, :, :2], k[0, :, :2])
    assert torch.equal(rk[0, :, 2], torch.zeros(2, 4))  # invalid token not written
    assert torch.equal(rk[1, :, 5:8], k[1]) and torch.equal(rv[1, :, 5:8], v[1])
    assert torch.count_nonzero(cache.k[0]) == 0  # other layers untouched
    assert torch.count_nonzero(cache.k[1][1]) == 0  # other slots untouched


def test_rollback_is_setting_the_length_back_without_copying() -> None:
    caches = SlotCaches(_cache(), _cache())
    storage = caches.target.k[0].data_ptr()
    caches.set_length(1, 7)
    assert caches.target.length(1) == caches.drafter.length(1) == 7  # type: ignore[union-attr]
    assert caches.usage() == pytest.approx(7 / 24)
    caches.set_length(1, 4)  # reject three draft tokens
    assert caches.target.length(1) == 4 and caches.target.k[0].data_ptr() == storage
    caches.release(1)
    assert caches.target.lengths == [0, 0, 0] and caches.usage() == 0.0
    with pytest.raises(ValueError, match="outside"):
        caches.set_length(0, 9)
