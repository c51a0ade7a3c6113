"""Start-up calibration runs real steps on scratch slots and leaves them empty."""

from __future__ import annotations

import torch

from engine.calibration import calibrate_state, measure_grid
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
