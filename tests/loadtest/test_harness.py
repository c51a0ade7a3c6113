"""The benchmarks' shared pieces: loops, percentiles, argument types, tables, prompts."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from collections import Counter
from pathlib import Path

import pytest

from loadtest.harness import (
    aligned,
    bench_prompts,
    closed_loop,
    int_list,
    percentile,
    pinned,
    positive_int,
    round_order,
    share_of_one,
    timed_loop,
)


def test_closed_loop_serves_every_request_with_at_most_its_concurrency() -> None:
    in_flight, peak = 0, 0

    async def send(i: int) -> int:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.001)
        in_flight -= 1
        return i * i

    results, wall = asyncio.run(closed_loop(10, 3, send))
    assert results == [i * i for i in range(10)]
    assert peak == 3 and wall > 0


def test_timed_loop_runs_every_user_until_the_deadline() -> None:
    ends: list[float] = []

    async def user(deadline: float) -> None:
        await asyncio.sleep(max(0.0, deadline - time.perf_counter()))
        ends.append(time.perf_counter() - deadline)

    wall = asyncio.run(timed_loop(3, 0.1, user))
    assert len(ends) == 3 and all(0 <= late < 0.1 for late in ends)
    assert 0.1 <= wall < 1.0


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [([], 50, None), ([3.0], 99, 3.0), ([1, 2, 3, 4, 5], 50, 3), ([1, 2, 3, 4, 5], 100, 5)],
)
def test_percentile_is_nearest_rank(values: list[float], q: float, expected: float | None) -> None:
    assert percentile(values, q) == expected


def test_int_list_takes_positive_integers_only() -> None:
    assert int_list("1, 8,32") == [1, 8, 32]
    for bad in ("", "0", "a,b", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            int_list(bad)


def test_positive_int_takes_one_positive_integer() -> None:
    assert positive_int("3") == 3
    for bad in ("", "0", "a", "-2", "1,2"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_int(bad)


def test_share_of_one_lies_strictly_between_0_and_1() -> None:
    assert share_of_one("0.25") == 0.25
    for bad in ("", "0", "1", "1.5", "-0.1", "nan", "a"):
        with pytest.raises(argparse.ArgumentTypeError):
            share_of_one(bad)


def test_two_things_alternate() -> None:
    assert [round_order("AB", r) for r in range(3)] == [list("AB"), list("BA"), list("AB")]


@pytest.mark.parametrize("n", [3, 4, 5, 6])
def test_every_thing_runs_in_every_position_and_after_every_other_alike(n: int) -> None:
    """Over a cycle of rounds each runs in each position, and right after each other one,
    equally often: a drift over a round, or what a turn leaves behind for the next, falls
    on all alike. Rotating one order (A B C, B C A, C A B) fails the second half: B always
    follows A."""
    items = "ABCDEF"[:n]
    cycle = [round_order(items, r) for r in range(2 * n)]
    assert all(sorted(order) == list(items) for order in cycle)
    positions = Counter((i, x) for order in cycle for i, x in enumerate(order))
    assert set(positions.values()) == {2}
    follows = Counter(pair for order in cycle for pair in itertools.pairwise(order))
    assert len(follows) == n * (n - 1)
    assert len(set(follows.values())) == 1
    assert round_order(items, 2 * n) == cycle[0]


def test_aligned_pads_columns() -> None:
    assert aligned([("a", "bbb"), ("cc", "d")]) == "a   bbb\ncc  d  "


def test_pinned_without_cpus_is_the_command() -> None:
    assert pinned(None, ["x"]) == ["x"]


def test_bench_prompts_read_json_and_json_lines(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps(["p1", {"prompt": "p2"}]))
    (tmp_path / "b.jsonl").write_text('{"prompt": "q1"}\n\n"q2"\n')
    assert bench_prompts(tmp_path / "a.json", 0) == ["p1", "p2"]
    assert bench_prompts(tmp_path / "b.jsonl", 1) == ["q1"]
