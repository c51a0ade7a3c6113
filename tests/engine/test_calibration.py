"""Start-up calibration runs real steps on scratch slots and leaves them empty."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine import calibration
from engine.adaptive import ContextTerm
from engine.calibration import calibrate_state, measure_context, measure_grid
from engine.speculative import SpecState
from tests.fixtures.tiny_models import random_drafter, random_target, tiny_target_config


def _state() -> SpecState:
    target = random_target(tiny_target_config(64, 2, tie_word_embeddings=False), seed=0)
    drafter = random_drafter(target, block_size=4, seed=1)
    return SpecState.create(target, drafter, 2, 64, 4, "cpu", torch.float32)


def test_measure_grid_covers_every_cell_and_leaves_the_slots_empty() -> None:
    state = _state()
    best, catch_up = measure_grid(state, [1, 2], [0, 3], context_tokens=16, passes=2, vocab=60)
    assert set(best) == {(1, 0), (1, 3), (2, 0), (2, 3)} and min(best.values()) > 0
    assert catch_up > 0  # seconds per position of drafter context caught up
    assert state.caches.target.lengths == [0, 0] and state.caches.drafter is not None
    assert state.caches.drafter.lengths == [0, 0]


def test_calibrated_grid_covers_batch_sizes_and_draft_counts() -> None:
    costs = calibrate_state(_state(), context_tokens=8, passes=2)
    assert costs.batch_sizes == (1, 2) and costs.num_drafts == (0, 1, 2, 3)
    for row in costs.seconds:
        assert list(row) == sorted(row) and row[0] > 0
    assert 0 < costs.catch_up_per_position < costs.seconds[0][0]


def test_the_context_term_is_fitted_from_a_long_context_and_the_slots_are_emptied() -> None:
    state = _state()
    costs = calibrate_state(state, context_tokens=8, passes=2)
    assert costs.context.tokens == 8  # the grid's context; the long one had room
    term = costs.context
    assert min(term.per_row_key, term.per_query_key, term.per_drafting_key) >= 0
    assert state.caches.target.lengths == [0, 0]
    seconds = measure_context(state, 2, [0, 1, 3], 48, passes=1)
    assert len(seconds) == 3 and min(seconds) > 0 and state.caches.target.lengths == [0, 0]


def test_no_context_term_without_room_for_a_long_context() -> None:
    costs = calibrate_state(_state(), context_tokens=40, passes=1)
    assert costs.context == ContextTerm()


def test_passes_go_on_until_the_minima_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    """A neighbour busy through the first five passes (every step twice as slow) and gone
    by the sixth: the sixth still finds the grid faster, so the passes go on until one
    finds nothing faster."""
    calls: list[int] = []
    cells = 4  # 2 batch sizes x 2 draft counts

    def timed(state: SpecState, rows: list[object], k: int, settle: bool = False) -> float:
        calls.append(k)
        busy = len(calls) <= cells * 6  # the warm-up and five passes
        return (2.0 if busy else 1.0) * (1 + len(rows) + k)

    monkeypatch.setattr(calibration, "_timed_step", timed)
    best, _ = measure_grid(_state(), [1, 2], [0, 3], context_tokens=16, passes=6, vocab=60)
    assert best == {(b, k): 1.0 + b + k for b in (1, 2) for k in (0, 3)}
    assert len(calls) == cells * (1 + 6 + 1)  # one more pass, which settled
    calls.clear()

    def ever_faster(state: SpecState, rows: list[object], k: int, settle: bool = False) -> float:
        calls.append(k)
        return 100.0 / len(calls)  # a machine that never settles

    monkeypatch.setattr(calibration, "_timed_step", ever_faster)
    measure_grid(_state(), [1, 2], [0, 3], context_tokens=16, passes=2, vocab=60)
    assert len(calls) == cells * (1 + 2 * (1 + calibration.MORE_PASSES))  # bounded


def test_each_batch_size_s_plain_cell_is_timed_after_a_step_like_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step right after a larger one runs slower (on a CPU: its caches hold the larger
    step's data), and a pass puts each batch size's plain cell right after the largest
    step of the batch size before. On a clock where such a step costs twice its tokens,
    every cell still reads its own cost: the plain cells are timed after an untimed step
    of their own kind, the others follow a smaller step of their own batch size."""
    clock = {"now": 0.0, "last": 0}

    def step(state: SpecState, rows: list[object], sampling: object, num_draft: int) -> None:
        tokens = len(rows) * (num_draft + 1)
        clock["now"] += tokens * (2.0 if clock["last"] > tokens else 1.0)
        clock["last"] = tokens

    monkeypatch.setattr(calibration, "spec_step", step)
    monkeypatch.setattr(calibration, "time", SimpleNamespace(perf_counter=lambda: clock["now"]))
    best, _ = measure_grid(_state(), [1, 2], [0, 3], context_tokens=16, passes=2, vocab=60)
    assert best == {(b, k): float(b * (k + 1)) for b in (1, 2) for k in (0, 3)}
    seconds = measure_context(_state(), 2, [0, 1, 3], 16, passes=1)
    assert seconds == [2.0, 4.0, 8.0]  # its plain step, too, follows its largest
