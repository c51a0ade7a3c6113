"""Slot KV cache: writes land in the right slot/position, rollback is a length change."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import CacheIndex, KVCache, PendingFeatures, SlotCaches


def _cache() -> KVCache:
    return KVCache(num_layers=2, num_slots=3, num_kv_heads=2, capacity=8, head_dim=4)


def _caches() -> SlotCaches:
    return SlotCaches(_cache(), _cache(), PendingFeatures(3, 8, 5, "cpu", torch.float32))


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
    caches = _caches()
    storage = caches.target.k[0].data_ptr()
    caches.set_length(1, 7, drafted=True)
    assert caches.target.length(1) == caches.drafter.length(1) == 7  # type: ignore[union-attr]
    assert caches.usage() == pytest.approx(7 / 24)
    caches.set_length(1, 4, drafted=True)  # reject three draft tokens
    assert caches.target.length(1) == 4 and caches.target.k[0].data_ptr() == storage
    caches.release(1)
    assert caches.target.lengths == [0, 0, 0] and caches.usage() == 0.0
    with pytest.raises(ValueError, match="outside"):
        caches.set_length(0, 9)


def test_a_move_carries_a_slots_context_and_pending_features() -> None:
    caches = _caches()
    assert caches.drafter is not None and caches.pending is not None
    for store in (*caches.target.k, *caches.target.v, *caches.drafter.k, *caches.drafter.v):
        store[2] = torch.randn(2, 8, 4)
    caches.pending.features[2] = torch.randn(8, 5)
    before = [store[2, :, :6].clone() for store in caches.target.k]
    drafted = [store[2, :, :4].clone() for store in caches.drafter.v]
    pending = caches.pending.features[2, 4:6].clone()
    caches.set_length(2, 4, drafted=True)
    caches.set_length(2, 6)  # two plain steps: positions 4 and 5 are pending
    caches.move(2, 0)
    assert (caches.target.lengths, caches.drafter.lengths) == ([6, 0, 0], [4, 0, 0])
    assert all(torch.equal(s[0, :, :6], b) for s, b in zip(caches.target.k, before, strict=True))
    assert all(torch.equal(s[0, :, :4], b) for s, b in zip(caches.drafter.v, drafted, strict=True))
    assert torch.equal(caches.pending.features[0, 4:6], pending)
    assert caches.lag(0, 6) == 4


def test_a_swap_exchanges_two_slots_contexts() -> None:
    caches = _caches()
    assert caches.drafter is not None and caches.pending is not None
    stores = (*caches.target.k, *caches.drafter.v, caches.pending.features)
    for store in stores:
        store.copy_(torch.randn(store.shape))
    was = [store.clone() for store in stores]
    caches.set_length(0, 5, drafted=True)
    caches.set_length(0, 7)  # pending 5..6
    caches.set_length(1, 3, drafted=True)
    caches.swap(0, 1)
    assert (caches.target.lengths, caches.drafter.lengths) == ([3, 7, 0], [3, 5, 0])
    target, drafter, pending = caches.target.k[0], caches.drafter.v[0], caches.pending.features
    assert torch.equal(target[1, :, :7], was[0][0, :, :7])
    assert torch.equal(target[0, :, :3], was[0][1, :, :3])
    assert torch.equal(drafter[1, :, :5], was[2][0, :, :5])
    assert torch.equal(pending[1, 5:7], was[-1][0, 5:7])
    assert torch.equal(caches.target.k[0][2], was[0][2])  # a third slot is untouched


def test_drafter_context_may_lag_never_lead() -> None:
    caches = _caches()
    assert caches.drafter is not None
    caches.set_length(0, 5, drafted=True)
    caches.set_length(0, 7)  # plain steps: the drafter context stays at 5
    assert (caches.target.length(0), caches.drafter.length(0), caches.lag(0, 7)) == (7, 5, 5)
    caches.set_length(0, 3)  # a rollback below it cuts it too
    assert caches.drafter.length(0) == 3 and caches.lag(0, 3) == 3
    with pytest.raises(ValueError, match="pending"):
        SlotCaches(_cache(), _cache())


@pytest.mark.parametrize("slots", [[1], [2, 0]])
def test_pending_features_are_stored_where_the_index_says(slots: list[int]) -> None:
    pending = PendingFeatures(3, 8, 5, "cpu", torch.float32)
    features = torch.randn(len(slots), 3, 5)
    positions = torch.tensor([[2, 3, 4]] * len(slots))
    index = CacheIndex.build(slots, [2] * len(slots), positions, None, "cpu")
    pending.write_at(index, features)
    for i, slot in enumerate(slots):
        rows, pos = torch.tensor([slot] * 3), torch.tensor([2, 3, 4])
        assert torch.equal(pending.gather(rows, pos), features[i])


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
