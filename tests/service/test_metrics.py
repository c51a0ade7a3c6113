"""Defensive parsing of what workers report, and the exposition of the gateway's series."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from service.metrics import (
    MULTIPROC_ENV,
    GatewayMetrics,
    SpecStats,
    Usage,
    parse_spec,
    parse_usage,
)

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


def test_exposition_has_the_design_names() -> None:
    metrics = GatewayMetrics()
    metrics.observe_spec("m", "p", parse_spec({"metrics": {"speculative_decoding": SPEC}}))
    metrics.observe_usage("m", "p", Usage(3, 7))
    metrics.set_worker_health("http://w:1", "p", True)
    text = metrics.render()[0].decode()
    for line in (
        'dflash_spec_steps_total{model="m",pool="p"} 2.0',
        'dflash_spec_draft_tokens_total{model="m",pool="p"} 6.0',
        'dflash_spec_accepted_tokens_total{model="m",pool="p"} 2.0',
        'dflash_spec_acceptance_length_sum{model="m",pool="p"} 2.5',
        'dflash_spec_draft_acceptance_rate_count{model="m",pool="p"} 1.0',
        'dflash_prompt_tokens_total{model="m",pool="p"} 3.0',
        'dflash_completion_tokens_total{model="m",pool="p"} 7.0',
        'dflash_worker_healthy{pool="p",worker="http://w:1"} 1.0',
    ):
        assert line in text
    metrics.set_worker_health("http://w:1", "p", None)
    assert "http://w:1" not in metrics.render()[0].decode()


def test_multiprocess_metrics_drop_workers_that_left_the_pool(tmp_path: Path) -> None:
    """In `--processes N` mode values live in per-process files that cannot be removed: a
    worker that left the pool must still vanish from /metrics (it did not, before)."""
    code = (
        "from service.metrics import GatewayMetrics\n"
        "m = GatewayMetrics()\n"
        "m.set_worker_health('w-a', 'p', True)\n"
        "m.set_worker_health('w-b', 'p', False)\n"
        "m.set_worker_health('w-a', 'p', None)\n"
        "m.requests.labels('m', 'p', 'chat', '200').inc()\n"
        "print(m.render()[0].decode())\n"
    )
    env = {**os.environ, MULTIPROC_ENV: str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert 'dflash_worker_healthy{pool="p",worker="w-b"} 0.0' in out
    assert "w-a" not in out
    assert 'dflash_requests_total{endpoint="chat",model="m",pool="p",status="200"} 1.0' in out
