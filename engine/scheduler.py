"""Continuous batching over a fixed number of cache slots. No torch.

Every engine step starts with `schedule()`: it retires finished and aborted sequences
(their slots come back), admits waiting requests into free slots in arrival order, and says
which sequences need a prefill and which decode. A full house queues requests; only a full
waiting queue as well refuses one (`QueueFull`).

Running sequences are kept in consecutive slots 0..n-1: when retiring leaves a hole, the
highest running sequences move down into it (`ScheduledBatch.moved`; the runner copies
their caches). A forward over consecutive slots reads their keys and values as views of
the cache, while any gap makes it gather (copy) every row's context at every layer: one
finished request among 32 made each following step up to 1.5x dearer until its slot was
filled again. A move copies one row's context once. The runner may also exchange two
running sequences' slots (to keep a step's drafting group consecutive): `seq.slot` is the
truth, and `running` is keyed by it again before each retirement.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.errors import QueueFull
from engine.sequence import Sequence, SequenceStatus, slot_of


@dataclass
class ScheduledBatch:
    """One step's work: new sequences to prefill, running ones to decode, and the
    sequences retired since the last step with the slots they gave back."""

    prefill: list[Sequence] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    retired: list[Sequence] = field(default_factory=list)
    freed_slots: list[int] = field(default_factory=list)
    # (from, to): running sequences moved down into freed slots, after `freed_slots` empty
    moved: list[tuple[int, int]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.prefill or self.decode or self.retired)


class Scheduler:
    def __init__(self, max_num_seqs: int, max_waiting: int) -> None:
        if max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        # Lowest slot first, so a lightly loaded engine touches few cache rows.
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) + len(self.running) >= self.max_num_seqs + self.max_waiting:
            raise QueueFull(
                f"the engine is full: {self.max_num_seqs} requests running and "
                f"{self.max_waiting} waiting; retry later"
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self, now: float) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._retire(batch, now)
        self._admit(batch, now)
        admitted = {id(s) for s in batch.prefill}
        batch.decode = [s for s in self.running.values() if id(s) not in admitted]
        return batch

    def retire(self, now: float) -> ScheduledBatch:
        """Retire without admitting (the end of a step, or shutdown)."""
        batch = ScheduledBatch()
        self._retire(batch, now)
        return batch

    def _retire(self, batch: ScheduledBatch, now: float) -> None:
        self.running = {slot_of(s): s for s in self.running.values()}
        for slot, seq in list(self.running.items()):
            if seq.abort_requested and not seq.finished:
                seq.finish("abort", now)
            if seq.finished:
                del self.running[slot]
                self._free_slots.append(slot)
                batch.retired.append(seq)
                batch.freed_slots.append(slot)
        if any(s.abort_requested for s in self.waiting):
            for seq in [s for s in self.waiting if s.abort_requested]:
                self.waiting.remove(seq)
                seq.finish("abort", now)
                batch.retired.append(seq)
        self._compact(batch)

    def _compact(self, batch: ScheduledBatch) -> None:
        """Move the highest running sequences into the holes below them."""
        n = len(self.running)
        holes = sorted(s for s in self._free_slots if s < n)
        movers = sorted(s for s in self.running if s >= n)
        for src, dst in zip(movers, holes, strict=True):
            seq = self.running.pop(src)
            seq.slot = dst
            self.running[dst] = seq
            batch.moved.append((src, dst))
        self._free_slots = list(range(self.max_num_seqs - 1, n - 1, -1))  # lowest last

    def _admit(self, batch: ScheduledBatch, now: float) -> None:
        while self.waiting and self._free_slots:
            seq = self.waiting.popleft()
            slot = self._free_slots.pop()
            seq.slot = slot
            seq.status = SequenceStatus.RUNNING
            seq.metrics.first_scheduled_time = now
            self.running[slot] = seq
            batch.prefill.append(seq)

    def abort_all(self) -> None:
        for seq in [*self.waiting, *self.running.values()]:
            seq.abort_requested = True
