"""Preallocated per-slot key/value caches.

A request owns one slot. Each layer keeps K and V as [slots, kv_heads, capacity, head_dim];
a slot's committed length lives on the host. Rolling back rejected draft tokens is just
setting that length back: entries past it are dead and get overwritten by the next write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:
    from engine.layers import LayerShape


class LayeredConfig(Protocol):
    """What a cache needs of a model's config (the target's and the drafter's have it)."""

    @property
    def num_hidden_layers(self) -> int: ...

    def layer_shape(self) -> LayerShape: ...


@dataclass(frozen=True)
class CacheIndex:
    """Where one forward reads and writes, worked out once for all its layers.

    `span` (first slot, rows) is set when the rows are consecutive slots in order: reads
    are then views of the cache (no copy of the context). `block` (slot, start) is set
    for one row whose tokens are all valid at consecutive positions: the write is a slice
    copy. Otherwise writes scatter the valid tokens (`rows`, `pos`, `select`)."""

    slots: Tensor  # [b]
    span: tuple[int, int] | None
    block: tuple[int, int] | None
    rows: Tensor | None  # [n] slot of each valid token
    pos: Tensor | None  # [n] its position
    select: Tensor | None  # [n] its index in the flattened [b * t]; None = every token

    @classmethod
    def build(
        cls,
        slots: list[int],
        starts: list[int],
        positions: Tensor,
        valid: Tensor | None,
        device: torch.device | str,
    ) -> CacheIndex:
        """slots/starts: host lists (first position of each row); positions/valid [b, t]."""
        slot_t = torch.tensor(slots, device=device)
        first = slots[0]
        span = (first, len(slots)) if slots == list(range(first, first + len(slots))) else None
        if len(slots) == 1 and valid is None:
            return cls(slot_t, span, (first, starts[0]), None, None, None)
        if valid is None:
            rows = slot_t[:, None].expand_as(positions).reshape(-1)
            return cls(slot_t, span, None, rows, positions.reshape(-1), None)
        select = valid.reshape(-1).nonzero().squeeze(1)
        rows = slot_t[:, None].expand_as(positions).reshape(-1).index_select(0, select)
        return cls(slot_t, span, None, rows, positions.reshape(-1).index_select(0, select), select)


@dataclass(frozen=True)
class KVCacheShape:
    """What a cache holds: `num_slots` slots of `capacity` positions."""

    num_slots: int
    capacity: int


class KVCache:
    """K/V storage for `num_layers` layers and `num_slots` request slots."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (num_slots, num_kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.capacity = capacity
        self.num_slots = num_slots
        self.lengths = [0] * num_slots

    @classmethod
    def for_model(
        cls,
        config: LayeredConfig,
        num_slots: int,
        capacity: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> KVCache:
        """A cache for every decoder layer of a model's config (target and drafter alike)."""
        shape = config.layer_shape()
        return cls(
            num_layers=config.num_hidden_layers,
            num_slots=num_slots,
            num_kv_heads=shape.num_key_value_heads,
            capacity=capacity,
            head_dim=shape.head_dim,
            device=device,
            dtype=dtype,
        )

    def write(
        self, layer: int, slots: Tensor, positions: Tensor, valid: Tensor, k: Tensor, v: Tensor
    ) -> None:
        """Store k/v [b, kv_heads, t, d] of rows `slots` [b] at `positions` [b, t] where `valid`."""
        rows = slots[:, None].expand_as(positions)[valid]  # [n] slot of each valid token
        pos = positions[valid]  # [n]
        # Advanced indices around a slice put the indexed dim first: cache[rows, :, pos] is
        # [n, kv_heads, d]; the new k/v [b, h, t, d] -> [b, t, h, d] -> [n, h, d] to match.
        self.k[layer][rows, :, pos] = k.transpose(1, 2)[valid].to(self.k[layer].dtype)
        self.v[layer][rows, :, pos] = v.transpose(1, 2)[valid].to(self.v[layer].dtype)

    def write_at(self, layer: int, index: CacheIndex, k: Tensor, v: Tensor) -> None:
        """Store k/v [b, kv_heads, t, d] where `index` says (see CacheIndex)."""
        if index.block is not None:
            slot, start = index.block
            t = k.shape[2]
            self.k[layer][slot, :, start : start + t] = k[0]
            self.v[layer][slot, :, start : start + t] = v[0]
            return
        assert index.rows is not None and index.pos is not None
        for store, new in ((self.k[layer], k), (self.v[layer], v)):
            flat = new.transpose(1, 2).reshape(-1, new.shape[1], new.shape[3])  # [b*t, h, d]
            if index.select is not None:
                flat = flat.index_select(0, index.select)
            store[index.rows, :, index.pos] = flat.to(store.dtype)

    def read_at(self, layer: int, index: CacheIndex, length: int) -> tuple[Tensor, Tensor]:
        """K/V for positions [0, length) of the index's rows; views when they are a span."""
        if index.span is not None:
            first, n = index.span
            return (
                self.k[layer][first : first + n, :, :length],
                self.v[layer][first : first + n, :, :length],
            )
        return self.read(layer, index.slots, length)

    def read(self, layer: int, slots: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """K/V of rows `slots` [b] for positions [0, length): each [b, kv_heads, length, d]."""
        return self.k[layer][slots, :, :length], self.v[layer][slots, :, :length]

    def move(self, src: int, dst: int) -> None:
        """Slot `src`'s committed positions into slot `dst` (whose own are dead); `src`
        is left empty."""
        n = self.lengths[src]
        for store in (*self.k, *self.v):
            store[dst, :, :n] = store[src, :, :n]
        self.lengths[dst], self.lengths[src] = n, 0

    def swap(self, a: int, b: int) -> None:
        """Exchange two slots' committed positions (and lengths)."""
        n = max(self.lengths[a], self.lengths[b])
        for store in (*self.k, *self.v):
            _exchange(store[a, :, :n], store[b, :, :n])
        self.lengths[a], self.lengths[b] = self.lengths[b], self.lengths[a]

    def set_length(self, slot: int, length: int) -> None:
        if not 0 <= length <= self.capacity:
            raise ValueError(f"slot length {length} outside [0, {self.capacity}]")
        self.lengths[slot] = length

    def length(self, slot: int) -> int:
        return self.lengths[slot]

    def usage(self) -> float:
        """Committed positions over allocated positions, 0..1."""
        return sum(self.lengths) / float(self.num_slots * self.capacity)

    def shape(self) -> KVCacheShape:
        return KVCacheShape(self.num_slots, self.capacity)


class PendingFeatures:
    """Target features [slots, capacity, n*hidden] the drafter has not projected yet.

    Projecting them into the drafter's context K/V is work only speculation needs, so it
    is put off (prefill and plain steps store the features here) and done in one batched
    pass when a row speculates again (`speculative.catch_up`). A slot's pending span is
    [drafter context length, target length); entries outside it are dead. Memory: slots x
    capacity x (drafter layers x target hidden) in the target's dtype (3 KB a position for
    the bundled pair in float32, 1.5x its drafter cache; 40 KB for an 8B target read at
    5 layers in bf16, about twice its drafter cache)."""

    def __init__(
        self,
        num_slots: int,
        capacity: int,
        width: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        self.features = torch.zeros(num_slots, capacity, width, device=device, dtype=dtype)

    def write_at(self, index: CacheIndex, features: Tensor) -> None:
        """Store features [b, t, width] where `index` says (the target's write index)."""
        if index.block is not None:
            slot, start = index.block
            self.features[slot, start : start + features.shape[1]] = features[0]
            return
        assert index.rows is not None and index.pos is not None
        flat = features.reshape(-1, features.shape[-1])  # [b*t, width]
        if index.select is not None:
            flat = flat.index_select(0, index.select)
        self.features[index.rows, index.pos] = flat.to(self.features.dtype)

    def move(self, src: int, dst: int, start: int, end: int) -> None:
        """Slot `src`'s features at positions [start, end) into slot `dst`."""
        self.features[dst, start:end] = self.features[src, start:end]

    def swap(self, a: int, b: int, start: int, end: int) -> None:
        """Exchange two slots' features at positions [start, end)."""
        _exchange(self.features[a, start:end], self.features[b, start:end])

    def gather(self, rows: Tensor, pos: Tensor) -> Tensor:
        """Features at (rows[i], pos[i]) -> [n, width]."""
        return self.features[rows, pos]


class SlotCaches:
    """The caches one engine step touches: the target's and (optionally) the drafter's
    context K/V with the features it has yet to project.

    A slot's drafter context may lag its target length (never exceed it): positions in
    between have their features in `pending`."""

    def __init__(
        self, target: KVCache, drafter: KVCache | None, pending: PendingFeatures | None = None
    ) -> None:
        if (drafter is None) != (pending is None):
            raise ValueError("a drafter cache comes with its pending features, and only then")
        self.target = target
        self.drafter = drafter
        self.pending = pending

    def set_length(self, slot: int, length: int, *, drafted: bool = False) -> None:
        """Commit/rollback a slot to `length` target positions. `drafted`: the drafter's
        context covers them too; otherwise it keeps what it had, cut back to `length`."""
        self.target.set_length(slot, length)
        if self.drafter is not None:
            kept = length if drafted else min(self.drafter.length(slot), length)
            self.drafter.set_length(slot, kept)

    def lag(self, slot: int, position: int) -> int:
        """First position before `position` whose drafter context is missing."""
        return position if self.drafter is None else min(self.drafter.length(slot), position)

    def release(self, slot: int) -> None:
        self.set_length(slot, 0)

    def move(self, src: int, dst: int) -> None:
        """A running request's caches from slot `src` into the free slot `dst` (the
        scheduler keeps running slots consecutive: see Scheduler); `src` is left empty."""
        end = self.target.length(src)
        self.target.move(src, dst)
        if self.drafter is not None and self.pending is not None:
            start = self.drafter.length(src)
            self.drafter.move(src, dst)
            self.pending.move(src, dst, start, end)

    def swap(self, a: int, b: int) -> None:
        """Exchange two running requests' caches (a step's drafting group is then one run
        of consecutive slots: see ModelRunner.decode)."""
        if self.drafter is not None and self.pending is not None:
            start = min(self.drafter.length(a), self.drafter.length(b))
            end = max(self.target.length(a), self.target.length(b))
            self.pending.swap(a, b, start, end)
            self.drafter.swap(a, b)
        self.target.swap(a, b)

    def usage(self) -> float:
        return self.target.usage()


def _exchange(x: Tensor, y: Tensor) -> None:
    """Swap the contents of two same-shaped views in place."""
    kept = x.clone()
    x.copy_(y)
    y.copy_(kept)
