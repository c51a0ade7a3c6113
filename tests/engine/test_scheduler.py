"""Continuous batching with integers: admission, queueing, retirement, aborts."""

from __future__ import annotations

import random
from collections.abc import Sequence as Seq

import pytest

from engine.scheduler import QueueFull, Scheduler
from engine.sequence import SamplingParams, Sequence, SequenceStatus


class NoText:
    def push(self, token_ids: Seq[int]) -> str:
        return ""


def seq(name: str, max_tokens: int = 4) -> Sequence:
    return Sequence(
        name,
        [1, 2, 3],
        SamplingParams(max_tokens=max_tokens),
        detokenizer=NoText(),
        eos_token_ids=frozenset({0}),
        max_model_len=100,
        arrival_time=0.0,
    )


def test_full_slots_queue_requests_in_arrival_order() -> None:
    sched = Scheduler(max_num_seqs=2, max_waiting=5)
    seqs = [seq(f"r{i}") for i in range(4)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule(now=1.0)
    assert [s.request_id for s in batch.prefill] == ["r0", "r1"]
    assert {s.slot for s in batch.prefill} == {0, 1}
    assert batch.decode == []
    assert sched.num_running == 2 and sched.num_waiting == 2
    assert seqs[0].metrics.first_scheduled_time == 1.0
    assert seqs[2].status is SequenceStatus.WAITING and seqs[2].slot is None
    again = sched.schedule(now=2.0)
    assert again.prefill == [] and [s.request_id for s in again.decode] == ["r0", "r1"]


def test_queue_full_only_when_slots_and_queue_are_taken() -> None:
    sched = Scheduler(max_num_seqs=2, max_waiting=1)
    for i in range(3):
        sched.add(seq(f"r{i}"))
    with pytest.raises(QueueFull, match="retry later"):
        sched.add(seq("r3"))
    sched.schedule(now=0.0)  # admission does not make room: r2 is still queued
    with pytest.raises(QueueFull):
        sched.add(seq("r3"))


def test_finished_sequence_frees_its_slot_for_the_next_waiting() -> None:
    sched = Scheduler(max_num_seqs=1, max_waiting=4)
    a, b = seq("a", max_tokens=1), seq("b")
    sched.add(a)
    sched.add(b)
    sched.schedule(now=0.0)
    a.append([5], now=1.0)  # max_tokens 1: finished
    assert a.finished
    batch = sched.schedule(now=2.0)
    assert batch.retired == [a] and batch.freed_slots == [0]
    assert batch.prefill == [b] and b.slot == 0
    assert b.metrics.first_scheduled_time == 2.0


def test_abort_running_and_waiting() -> None:
    sched = Scheduler(max_num_seqs=1, max_waiting=4)
    a, b, c = seq("a"), seq("b"), seq("c")
    for s in (a, b, c):
        sched.add(s)
    sched.schedule(now=0.0)
    a.abort_requested = True
    b.abort_requested = True
    batch = sched.schedule(now=1.0)
    assert {s.request_id for s in batch.retired} == {"a", "b"}
    assert a.finish_reason == "abort" and b.finish_reason == "abort"
    assert batch.freed_slots == [0]
    assert batch.prefill == [c] and sched.num_waiting == 0


def test_retire_without_admitting() -> None:
    sched = Scheduler(max_num_seqs=1, max_waiting=4)
    a, b = seq("a", max_tokens=1), seq("b")
    sched.add(a)
    sched.add(b)
    sched.schedule(now=0.0)
    a.append([4], now=0.5)
    batch = sched.retire(now=1.0)
    assert batch.retired == [a] and batch.prefill == [] and sched.num_waiting == 1


def test_abort_all_marks_everyone() -> None:
    sched = Scheduler(max_num_seqs=1, max_waiting=4)
    for name in "ab":
        sched.add(seq(name))
    sched.schedule(now=0.0)
    sched.abort_all()
    batch = sched.schedule(now=1.0)
    assert len(batch.retired) == 2 and not sched.has_work


def test_a_hole_left_by_a_finished_sequence_is_filled_from_the_top() -> None:
    sched = Scheduler(max_num_seqs=4, max_waiting=4)
    seqs = [seq(f"r{i}", max_tokens=1 if i in (0, 2) else 9) for i in range(4)]
    for s in seqs:
        sched.add(s)
    sched.schedule(now=0.0)
    assert [s.slot for s in seqs] == [0, 1, 2, 3]
    for s in seqs:
        s.append([5], now=1.0)  # r0 and r2 reach max_tokens
    batch = sched.retire(now=1.0)
    assert batch.freed_slots == [0, 2] and batch.moved == [(3, 0)]
    assert (seqs[1].slot, seqs[3].slot) == (1, 0)
    assert set(sched.running) == {0, 1} and sched.running[0] is seqs[3]
    late = seq("late")
    sched.add(late)
    assert sched.schedule(now=2.0).prefill == [late] and late.slot == 2


def test_random_churn_keeps_slots_exclusive_and_finishes_everyone() -> None:
    rng = random.Random(3)
    sched = Scheduler(max_num_seqs=3, max_waiting=50)
    pending = [seq(f"r{i}", max_tokens=rng.randint(1, 9)) for i in range(30)]
    done: list[Sequence] = []
    for step in range(1000):
        while pending and rng.random() < 0.4:
            sched.add(pending.pop())
        batch = sched.schedule(now=float(step))
        done += batch.retired
        slots = sorted(s.slot for s in sched.running.values() if s.slot is not None)
        assert slots == list(range(len(slots))) and len(slots) <= 3  # consecutive from 0
        for s in batch.prefill + batch.decode:
            if rng.random() < 0.05:
                s.abort_requested = True
            s.append([rng.randint(1, 50) for _ in range(rng.randint(1, 4))], float(step))
        if not pending and not sched.has_work:
            break
    assert len(done) == 30 and all(s.finished for s in done)
    assert all(len(s.output_token_ids) <= s.params.max_tokens for s in done)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        Scheduler(max_num_seqs=0, max_waiting=1)
    with pytest.raises(ValueError):
        Scheduler(max_num_seqs=1, max_waiting=-1)
