"""The weighted split among the pools of one model."""

from __future__ import annotations

from collections import Counter

import pytest

from service.routing.split import SmoothWeighted, by_key, effective_weights, pool_of


def test_smooth_round_robin_gives_exact_shares_interleaved() -> None:
    turn = SmoothWeighted()
    picks = [turn.pick({"a": 90, "b": 10}) for _ in range(1000)]
    assert Counter(picks) == {"a": 900, "b": 100}
    # Interleaved: no window of 10 requests goes without its `b`.
    assert all("b" in picks[i : i + 10] for i in range(0, 1000, 10))


def test_a_pool_that_is_not_offered_gives_its_share_to_the_others() -> None:
    turn = SmoothWeighted()
    assert {turn.pick({"a": 90}) for _ in range(50)} == {"a"}
    picks = [turn.pick({"a": 50, "b": 25, "c": 25}) for _ in range(400)]
    assert Counter(picks) == {"a": 200, "b": 100, "c": 100}


def test_weight_zero_pools_are_a_fallback_only() -> None:
    assert effective_weights({"a": 10, "b": 0}) == {"a": 10}
    assert effective_weights({"b": 0, "c": 0}) == {"b": 1.0, "c": 1.0}
    turn = SmoothWeighted()
    assert {turn.pick({"a": 10, "b": 0}) for _ in range(20)} == {"a"}


def test_keys_stick_to_a_pool_and_split_by_weight() -> None:
    weights = {"a": 75, "b": 25}
    keys = [f"conversation {i}" for i in range(4000)]
    first = [by_key(key, weights) for key in keys]
    assert first == [by_key(key, weights) for key in keys]  # sticky
    share = Counter(first)["a"] / len(keys)
    assert share == pytest.approx(0.75, abs=0.03)
    # A third pool joining takes keys from both, and moves no key between a and b.
    moved = [by_key(key, {**weights, "c": 100}) for key in keys]
    assert all(after in (before, "c") for before, after in zip(first, moved, strict=True))


def test_pool_of_keeps_one_turn_per_model() -> None:
    turns: dict[str, SmoothWeighted] = {}
    weights = {"a": 1, "b": 1, "x": 1}
    assert pool_of("m", ["x"], weights, None, turns) == "x"
    picks = [pool_of("m", ["a", "b"], weights, None, turns) for _ in range(10)]
    assert Counter(picks) == {"a": 5, "b": 5} and set(turns) == {"m"}
    assert pool_of("m", ["a", "b"], weights, "key", turns) == by_key("key", {"a": 1, "b": 1})
