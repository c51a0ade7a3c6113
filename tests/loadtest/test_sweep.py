"""`dflash-bench sweep`: the curve math on recorded data, the files, and a real two-pool run."""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path

import pytest

from loadtest.chat_stream import RequestRecord
from loadtest.sweep import (
    Point,
    Target,
    compare,
    default_interactivity,
    format_comparison,
    format_table,
    main,
    parse_concurrency,
    parse_target,
    read_csv,
    summarize,
    throughput_at,
    tokens_in_window,
    write_csv,
)
from tests.fixtures.worker import WorkerHandle


def _record(start: float, ttft: float, latency: float, tokens: int, **kw: object) -> RequestRecord:
    fields: dict[str, object] = dict(
        kind="code", start=start, latency_s=latency, ttft_s=ttft, output_tokens=tokens,
        prompt_tokens=10, chunks=tokens, acceptance_length=None, finish_reason="length",
    )  # fmt: skip
    fields.update(kw)
    return RequestRecord(**fields)  # type: ignore[arg-type]


def _point(target: str, conc: int, user: float | None, total: float) -> Point:
    return Point(
        target=target, url="http://127.0.0.1:1", concurrency=conc, duration_s=10.0,
        requests=5, failures=0, output_tokens=100, throughput_tok_s=total,
        per_user_tok_s=user, ttft_ms=50.0, tpot_ms=None if user is None else 1000 / user,
        acceptance_length=None,
    )  # fmt: skip


# Recorded shape of a sweep: plain reaches 20 tok/s per user only alone; DFlash is faster.
PLAIN = [_point("plain", 1, 20.0, 20.0), _point("plain", 2, 15.0, 30.0),
         _point("plain", 4, 9.0, 36.0)]  # fmt: skip
DFLASH = [_point("dflash", 1, 50.0, 50.0), _point("dflash", 2, 40.0, 80.0),
          _point("dflash", 4, 25.0, 100.0), _point("dflash", 8, 12.0, 96.0)]  # fmt: skip


def test_tokens_in_window_apportions_the_decode_span() -> None:
    # first token at t=1, 10 more tokens spread over [1, 3]
    record = _record(start=0.0, ttft=1.0, latency=3.0, tokens=11)
    assert tokens_in_window(record, 0.0, 10.0) == pytest.approx(11)
    assert tokens_in_window(record, 0.0, 2.0) == pytest.approx(1 + 5)
    assert tokens_in_window(record, 2.5, 10.0) == pytest.approx(2.5)
    assert tokens_in_window(_record(0.0, 1.0, 3.0, 11, error="boom"), 0.0, 10.0) == 0.0
    burst = _record(start=0.0, ttft=1.0, latency=1.0, tokens=4)  # everything in one chunk
    assert tokens_in_window(burst, 0.0, 2.0) == 4
    unstreamed = _record(start=0.0, ttft=None, latency=2.0, tokens=10)  # type: ignore[arg-type]
    assert tokens_in_window(unstreamed, 0.0, 1.0) == pytest.approx(5)


def test_summarize_turns_records_into_one_point() -> None:
    records = [
        _record(100.0, 0.1, 1.1, 11, acceptance_length=3.0),
        _record(101.0, 0.1, 2.1, 11, acceptance_length=5.0),
        _record(101.5, 0.0, 0.2, 0, error="HTTP 503"),
    ]
    point = summarize(Target("dflash", "http://x"), 2, 10.0, records)
    assert (point.requests, point.failures, point.output_tokens) == (2, 1, 22)
    assert point.throughput_tok_s == pytest.approx(2.2)
    assert point.per_user_tok_s == pytest.approx((10 / 1.0 + 10 / 2.0) / 2)
    assert point.ttft_ms == pytest.approx(100.0)
    assert point.acceptance_length == pytest.approx(4.0)
    empty = summarize(Target("p", "http://x"), 1, 10.0, [])
    assert (empty.requests, empty.throughput_tok_s, empty.per_user_tok_s) == (0, 0.0, None)


def test_throughput_at_interpolates_bounds_and_refuses_the_unreachable() -> None:
    assert throughput_at(PLAIN, 20.0) == (20.0, "interpolated")
    value, kind = throughput_at(PLAIN, 12.0)
    assert kind == "interpolated" and value == pytest.approx(33.0)
    assert throughput_at(PLAIN, 25.0) == (None, "unreachable")
    assert throughput_at(PLAIN, 5.0) == (36.0, "lower_bound")
    value, kind = throughput_at(DFLASH, 20.0)
    assert kind == "interpolated" and value == pytest.approx(96 + 4 * 8 / 13)
    assert throughput_at([_point("x", 1, None, 0.0)], 1.0) == (None, "unreachable")


def test_compare_at_the_baselines_concurrency_one_level() -> None:
    points = PLAIN + DFLASH
    level = default_interactivity(points, "plain")
    assert level == 20.0
    plain, dflash = compare(points, "plain", 20.0)
    assert plain.target == "plain" and plain.ratio == pytest.approx(1.0)
    assert dflash.ratio == pytest.approx((96 + 4 * 8 / 13) / 20.0)
    text = format_comparison("plain", level, [plain, dflash])
    assert "4.92x plain" in text and "20.0 tokens/s per user" in text
    lower = compare([*PLAIN, _point("big", 1, 30.0, 60.0), _point("big", 2, 25.0, 75.0)],
                    "plain", 20.0)[1]  # fmt: skip
    assert lower.kind == "lower_bound" and ">= 3.75x" in format_comparison("plain", 20.0, [lower])
    assert compare(PLAIN, "plain", 40.0)[0].ratio is None


def test_csv_round_trip_and_table(tmp_path: Path) -> None:
    points = [*PLAIN, _point("plain", 8, None, 0.0)]
    write_csv(points, tmp_path / "s.csv")
    assert read_csv(tmp_path / "s.csv") == points
    table = format_table(points).splitlines()
    assert table[0].split()[:3] == ["target", "conc", "reqs"] and len(table) == 5


def test_argument_parsing() -> None:
    assert parse_target("dflash=http://127.0.0.1:8000") == Target("dflash", "http://127.0.0.1:8000")
    assert parse_concurrency("4,1,2,2") == [1, 2, 4]
    for bad in ("nourl", "=http://x", "a=ftp://x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_target(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_concurrency("0,1")


def test_replot_recomputes_files_from_a_recorded_csv(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_csv([*PLAIN, *DFLASH], tmp_path / "sweep.csv")
    assert main(["--replot", "--out-dir", str(tmp_path), "--interactivity", "15"]) == 0
    report = json.loads((tmp_path / "sweep.json").read_text())
    assert report["baseline"] == "plain" and report["interactivity_tok_s"] == 15.0
    ratios = {e["target"]: e["ratio"] for e in report["at_interactivity"]}
    # dflash at 15 tok/s per user: between its c=8 (12, 96) and c=4 (25, 100) points
    assert ratios == {"plain": 1.0, "dflash": pytest.approx((96 + 4 * 3 / 13) / 30.0)}
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with (tmp_path / "sweep.csv").open() as src:
        assert len(list(csv.DictReader(src))) == 7
    assert "dflash" in capsys.readouterr().out


def test_sweep_over_a_dflash_and_a_plain_worker_writes_curves_and_ratio(
    dflash_worker: WorkerHandle, plain_worker: WorkerHandle, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    argv = [
        "--target", f"plain={plain_worker.base_url}",
        "--target", f"dflash={dflash_worker.base_url}/v1",
        "--concurrency", "1,2", "--duration", "3", "--max-tokens", "12", "--out-dir", str(tmp_path),
    ]  # fmt: skip
    assert main(argv) == 0
    with (tmp_path / "sweep.csv").open() as src:
        rows = list(csv.DictReader(src))
    assert [(r["target"], r["concurrency"]) for r in rows] == [
        ("plain", "1"), ("plain", "2"), ("dflash", "1"), ("dflash", "2")
    ]  # fmt: skip
    assert all(r["failures"] == "0" and int(r["requests"]) > 0 for r in rows)
    assert all(float(r["throughput_tok_s"]) > 0 and float(r["per_user_tok_s"]) > 0 for r in rows)
    assert {r["target"] for r in rows if r["acceptance_length"]} == {"dflash"}
    report = json.loads((tmp_path / "sweep.json").read_text())
    plain_c1 = next(p for p in report["points"] if p["target"] == "plain" and p["concurrency"] == 1)
    assert report["baseline"] == "plain"
    assert report["interactivity_tok_s"] == pytest.approx(plain_c1["per_user_tok_s"])
    estimates = {e["target"]: e for e in report["at_interactivity"]}
    assert estimates["plain"]["ratio"] == pytest.approx(1.0)
    assert set(estimates) == {"plain", "dflash"}
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "runs/dflash-c2/locust_stats.csv").exists()
    out = capsys.readouterr().out
    print(out)
    table_rows = [line for line in out.splitlines() if re.match(r"(plain|dflash) +\d+ ", line)]
    assert len(table_rows) == 4 and "tokens/s per user (baseline: plain)" in out
