"""EngineConfig's one derived quantity: how many tokens a step verifies."""

from __future__ import annotations

import pytest

from engine.config import block_size_for


@pytest.mark.parametrize(
    ("k", "drafter_block", "expected"),
    [(None, None, 1), (0, None, 1), (None, 16, 16), (7, 16, 8), (0, 16, 1), (15, 16, 16)],
)
def test_block_size(k: int | None, drafter_block: int | None, expected: int) -> None:
    assert block_size_for(k, drafter_block) == expected


@pytest.mark.parametrize(("k", "drafter_block"), [(3, None), (16, 16), (-1, 16)])
def test_impossible_speculation_is_refused(k: int, drafter_block: int | None) -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        block_size_for(k, drafter_block)
