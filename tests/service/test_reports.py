"""Defensive parsing of what workers report: usage and the speculation summary."""

from __future__ import annotations

from typing import Any

import pytest

from service.reports import SpecStats, Usage, parse_spec, parse_usage

SPEC = {
    "mean_acceptance_length": 2.5,
    "draft_acceptance_rate": 0.5,
    "acceptance_histogram": [1, 0, 1, 0],
    "num_spec_steps": 2,
    "num_accepted_draft_tokens": 2,
    "num_draft_tokens": 6,
    "num_spec_tokens": 3,
}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"usage": {"prompt_tokens": 3, "completion_tokens": 7}}, Usage(3, 7)),
        ({"usage": None}, None),
        ({}, None),
        ({"usage": {"prompt_tokens": "3", "completion_tokens": True}}, None),
        ({"usage": {"completion_tokens": 5}}, Usage(0, 5)),
        ([], None),
    ],
)
def test_usage_is_parsed_defensively(body: Any, expected: Usage | None) -> None:
    assert parse_usage(body) == expected


def test_full_spec_summary() -> None:
    assert parse_spec({"metrics": {"speculative_decoding": SPEC}}) == [
        SpecStats(
            steps=2, draft_tokens=6, accepted_tokens=2, acceptance_length=2.5, acceptance_rate=0.5
        )
    ]


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"metrics": None},
        {"metrics": {}},
        {"metrics": {"speculative_decoding": None}},
        {"metrics": {"speculative_decoding": "x"}},
        {"metrics": 3},
        None,
    ],
)
def test_missing_or_null_spec_is_no_observation(body: Any) -> None:
    assert parse_spec(body) == []


def test_sparse_map_histogram_fills_missing_counters() -> None:
    spec = {"acceptance_histogram": {"0": 1, "3": 2}, "num_spec_tokens": 3}
    (stats,) = parse_spec({"metrics": {"speculative_decoding": spec}})
    # 3 steps, 6 accepted (2 steps x 3), 9 drafted (3 steps x 3 per step)
    assert stats == SpecStats(3, 9, 6, 1.0 + 6 / 3, 6 / 9)


def test_per_choice_list_for_n_above_one() -> None:
    body = {"metrics": [{"speculative_decoding": SPEC}, None, {"speculative_decoding": SPEC}]}
    assert [s.steps for s in parse_spec(body)] == [2, 2]


def test_malformed_numbers_are_skipped_not_raised() -> None:
    spec = {
        **SPEC,
        "num_spec_steps": -1,
        "mean_acceptance_length": float("nan"),
        "acceptance_histogram": [True, "x", 2],
    }
    (stats,) = parse_spec({"metrics": {"speculative_decoding": spec}})
    assert stats.steps == 2  # from the histogram's one valid entry (index 2: 2 steps)
    assert stats.acceptance_length == 1.0 + 2 / 2
