"""Slot KV cache: writes land in the right slot/position, rollback is a length change."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import CacheIndex, KVCache, SlotCaches


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


@pytest.mark.parametrize(
    ("slots", "valid"),
    [
        ([1], None),  # one row, all valid: slice copy
        ([0, 1], None),  # consecutive slots: reads are views
        ([2, 0], None),  # scattered slots
        ([2, 0], [[True, True, False], [True, False, False]]),  # padded rows
    ],
)
def test_indexed_write_and_read_equal_the_plain_ones(
    slots: list[int], valid: list[list[bool]] | None
) -> None:
    plain, indexed = _cache(), _cache()
    b = len(slots)
    k = torch.randn(b, 2, 3, 4)
    v = torch.randn(b, 2, 3, 4)
    starts = [4, 1][:b]
    positions = torch.tensor(starts)[:, None] + torch.arange(3)[None]
    mask = torch.ones(b, 3, dtype=torch.bool) if valid is None else torch.tensor(valid)
    plain.write(0, torch.tensor(slots), positions, mask, k, v)
    index = CacheIndex.build(slots, starts, positions, None if valid is None else mask, "cpu")
    indexed.write_at(0, index, k, v)
    assert torch.equal(plain.k[0], indexed.k[0]) and torch.equal(plain.v[0], indexed.v[0])
    rk, rv = indexed.read_at(0, index, 7)
    ek, ev = plain.read(0, torch.tensor(slots), 7)
    assert torch.equal(rk, ek) and torch.equal(rv, ev)
    assert (index.span is not None) == (slots in ([1], [0, 1]))
