"""`dflash-bench speedup`: the workload, the report's arithmetic on known rounds, option
checks, and a --quick run against two real embedded workers (speed is never asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import backends_bench as bb
from loadtest import bench
from loadtest import speedup_bench as sb


def test_spread_covers_the_range_on_a_log_scale() -> None:
    assert sb.spread(32, 512, 5) == [32, 64, 128, 256, 512]
    assert sb.spread(64, 64, 3) == [64, 64, 64] and sb.spread(8, 16, 1) == [8]


def test_workload_prompts_and_answers_span_their_ranges() -> None:
    requests = sb.build_workload(8, (32, 512), (64, 256))
    lengths = [r.prompt_tokens for r in requests]
    assert min(lengths) <= 40 and max(lengths) >= 480  # re-encoding may move a few tokens
    assert sorted(r.max_tokens for r in requests) == sb.spread(64, 256, 8)
    assert {r.endpoint for r in requests} == {"chat", "completions"}
    assert all(r.prompt.strip() for r in requests)
    chat = sb.request_body(next(r for r in requests if r.endpoint == "chat"), stream=True)
    assert chat["messages"][0]["content"] and chat["stream_options"] == {"include_usage": True}
    plain = sb.request_body(next(r for r in requests if r.endpoint == "completions"), False)
    assert "prompt" in plain and "stream_options" not in plain and plain["ignore_eos"] is True


def _outcome(tokens: int, accept: float | None, plain_steps: int = 0) -> sb.Outcome:
    return sb.Outcome(tokens, 1.0, accept, 4 if accept else 0, plain_steps)


def test_rows_pair_rounds_and_count_plain_steps() -> None:
    fast, plain = sb.Cell(), sb.Cell()
    fast.add_round([_outcome(30, 3.0, plain_steps=4), None], 1.0)  # 30 tok/s, one error
    fast.add_round([_outcome(20, 2.0), _outcome(20, 2.0)], 1.0)  # 40 tok/s
    plain.add_round([_outcome(20, None), _outcome(20, None)], 2.0)  # 20 tok/s
    plain.add_round([_outcome(20, None), _outcome(20, None)], 1.0)  # 40 tok/s
    cells = {("dflash", False, 4): fast, ("plain", False, 4): plain}
    (row,) = sb.result_rows(cells, [False], [4])
    assert row["dflash_tokens_per_second"] == pytest.approx(70 / 2.0)
    assert row["plain_tokens_per_second"] == pytest.approx(80 / 3.0)
    assert row["ratio"] == pytest.approx(35 / (80 / 3))
    assert row["ratio_per_round"] == pytest.approx([1.5, 1.0])
    assert row["mean_acceptance_length"] == pytest.approx(7 / 3)
    assert row["plain_step_share"] == pytest.approx(4 / (4 + 12))
    assert row["errors"] == 1
    assert "1.00-1.50" in sb.format_table({"results": [row]})


def test_defaults_quick_and_bad_options() -> None:
    full = sb.parse_args([])
    assert full.concurrency == [1, 2, 4, 8, 16, 32] and full.max_num_seqs == 32
    assert full.streams == [False, True] and full.prompt_tokens == (32, 512)
    assert sb.parse_args(["--quick", "--stream", "yes"]).streams == [True]
    for bad in (["--rounds", "0"], ["--prompt-tokens", "9-3"], ["--stream", "maybe"],
                ["--max-model-len", "300"], ["--round", "2"]):  # fmt: skip
        with pytest.raises(SystemExit):
            sb.parse_args(bad)


def test_workers_are_started_with_their_defaults() -> None:
    args = sb.parse_args(["--quick"])
    dflash = sb.worker_argv(bb.WorkerSpec("embedded", "dflash"), 9, args)
    plain = sb.worker_argv(bb.WorkerSpec("embedded", "plain"), 9, args)
    assert plain == [*dflash, "--no-speculation"]
    assert "--speculation" not in dflash  # adaptive, the worker's default


def test_quick_run_against_embedded_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(bb.REPO))
    out = tmp_path / "speedup.json"
    assert bench.main(["speedup", "--quick", "--json", str(out)]) == 0
    assert "DFlash tok/s" in capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [(r["stream"], r["concurrency"]) for r in rows] == [
        (False, 1), (False, 2), (True, 1), (True, 2)
    ]  # fmt: skip
    for r in rows:
        assert r["errors"] == 0 and r["ratio"] is not None and r["ratio"] > 0
        assert r["generated_tokens"]["dflash"] == r["generated_tokens"]["plain"] > 0
        assert r["plain_step_share"] is not None
    assert len(report["workload"]) == 4 and report["workers"]["plain"][-1] == "--no-speculation"


def test_starts_report_each_start_and_their_spread() -> None:
    assert sb.parse_args(["--starts", "3"]).starts == 3
    for bad in (["--starts", "0"], ["--starts", "2", "--matrix"]):
        with pytest.raises(SystemExit):
            sb.parse_args(bad)
    starts = []
    for fast_tokens in (30, 20):  # DFlash 1.5x plain after the first start, 1.0x after the second
        fast, plain = sb.Cell(), sb.Cell()
        fast.add_round([_outcome(fast_tokens, 3.0)], 1.0)
        plain.add_round([_outcome(20, None)], 1.0)
        starts.append({("dflash", False, 1): fast, ("plain", False, 1): plain})
    spread = sb.start_spread(starts, [False], [1])
    assert [s["start"] for s in spread] == [1, 2]
    assert [s["results"][0]["ratio"] for s in spread] == pytest.approx([1.5, 1.0])
    assert "stream=no c=1: 1.00-1.50  (1.50 1.00)" in sb.format_spread(spread)


def test_two_starts_with_both_workers_starting_together(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(bb.REPO))
    out = tmp_path / "starts.json"
    argv = ["speedup", "--quick", "--starts", "2", "--stream", "no", "--concurrency", "1"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "spread over starts" in printed and printed.count("starting embedded-dflash") == 2
    report = json.loads(out.read_text())
    assert [s["start"] for s in report["starts"]] == [1, 2]
    assert all(r["ratio"] and r["errors"] == 0 for r in report["results"])
