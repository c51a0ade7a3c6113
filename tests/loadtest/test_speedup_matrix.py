"""`dflash-bench speedup --matrix`: the shapes, the per-class arithmetic of mixed streams,
the summary's worst cell, and a --quick run against two real embedded workers (speed is
never asserted)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.worker.settings import BUNDLED_DFLASH2
from loadtest import backends_bench as bb
from loadtest import bench
from loadtest import speedup_bench as sb
from loadtest import speedup_matrix as sm


def test_the_matrix_covers_every_level_of_every_axis() -> None:
    shapes = sm.SHAPES
    assert {s.prompt for s in shapes} == {sm.SHORT_PROMPT, sm.MEDIUM_PROMPT, sm.LONG_PROMPT}
    assert {(s.output, s.ignore_eos) for s in shapes} == {
        (sm.SHORT_OUTPUT, False),
        (sm.LONG_OUTPUT, True),
    }
    assert {s.arrivals for s in shapes} == {"burst", "closed"}
    assert {s.temperature for s in shapes} == {"0", "0.7", "mixed", "mixed-seeded"}
    assert any(s.stream for s in shapes)
    names = {s.name for s in shapes}
    for mixed in (s for s in shapes if s.temperature.startswith("mixed")):
        twin = next(s for s in shapes if s.name == mixed.twin)  # its greedy-only twin
        assert twin.temperature == "0" and twin.name in names
        assert (twin.prompt, twin.output, twin.arrivals) == (
            mixed.prompt,
            mixed.output,
            mixed.arrivals,
        )


def test_mixed_streams_alternate_and_bursts_are_one_or_two_per_client() -> None:
    mixed = next(s for s in sm.SHAPES if s.temperature == "mixed")
    assert [mixed.temperature_of(i) for i in range(4)] == [0.0, sm.SAMPLED, 0.0, sm.SAMPLED]
    assert [mixed.seed_of(i) for i in range(4)] == [None] * 4
    seeded = next(s for s in sm.SHAPES if s.temperature == "mixed-seeded")
    assert [seeded.temperature_of(i) for i in range(4)] == [0.0, sm.SAMPLED, 0.0, sm.SAMPLED]
    assert [seeded.seed_of(i) for i in range(4)] == [None, 1, None, 3]  # the sampled ones
    request = sb.Request("chat", "def f():", 4, 8)
    assert sb.request_body(request, False, sm.SAMPLED, seed=3)["seed"] == 3
    assert "seed" not in sb.request_body(request, False, sm.SAMPLED)
    burst = next(s for s in sm.SHAPES if s.arrivals == "burst")
    assert burst.num_requests(4, 3) == 6 and burst.num_requests(1, 3) == 1
    closed = next(s for s in sm.SHAPES if s.arrivals == "closed")
    assert closed.num_requests(4, 3) == 12
    # a cell sends at least --min-requests: small bursts are repeated
    assert [burst.repeats(c, 3, 8) for c in (1, 2, 4, 8)] == [8, 3, 2, 1]
    assert closed.repeats(1, 3, 8) == 3 and closed.repeats(4, 3, 8) == 1
    args = sb.parse_args(["--matrix", "--concurrency", "1,4"])
    assert args.min_requests == 8
    sizes = {
        s.name: len(reqs) for s, reqs in zip(sm.SHAPES, sm.workloads(args).values(), strict=True)
    }
    assert sizes[burst.name] == 12 and sizes[closed.name] == 12  # c=4: two bursts of six


def _out(tokens: int, latency: float, accept: float | None = None) -> sb.Outcome:
    return sb.Outcome(tokens, latency, accept, 2 if accept else 0, 0 if accept else 2)


def test_rows_report_each_class_and_the_worst_cell() -> None:
    mixed = sm.Shape("m", (8, 48), (32, 96), False, "closed", "mixed", twin="g")
    greedy = sm.Shape("g", (8, 48), (32, 96), False, "closed", "0")
    cells = {key: sm.MatrixCell() for key in
             [(w, s, 2) for w in ("dflash", "plain") for s in ("m", "g")]}  # fmt: skip
    labels = ["greedy", "sampled"]
    cells[("dflash", "m", 2)].add([_out(40, 1.0, 4.0), _out(10, 1.0, 1.0)], labels, 2.0)
    cells[("plain", "m", 2)].add([_out(20, 1.0), _out(20, 1.0)], labels, 1.0)
    cells[("dflash", "g", 2)].add([_out(50, 1.0, 5.0), _out(50, 1.0, 5.0)], ["greedy"] * 2, 1.0)
    cells[("plain", "g", 2)].add([_out(20, 1.0), None], ["greedy"] * 2, 1.0)
    rows = sm.matrix_rows(cells, [mixed, greedy], [2])
    m, g = rows
    assert m["ratio"] == pytest.approx(25 / 40)
    assert m["sampled_vs_plain"] == pytest.approx(10 / 20)
    assert m["greedy_vs_greedy_only"] == pytest.approx(40 / 50)
    assert "sampled_vs_plain" not in g and g["errors"] == 1 and g["ratio"] == pytest.approx(5)
    summary = sm.summary(rows)
    assert summary["worst_ratio"] == pytest.approx(25 / 40) and summary["worst_cell"] == "m c=2"
    assert summary["cells_below_0.98"] == 1 and summary["worst_sampled_vs_plain"] == 0.5
    table = sm.format_matrix({"results": rows, "summary": summary})
    assert "worst cell: 0.62 (m c=2)" in table


def test_c1_rows_compare_adaptive_with_each_fixed_k_and_another_tree() -> None:
    shape = sm.Shape("s", (8, 48), (32, 96), False, "burst", "0")
    cells = {
        (m, "s", 1): sm.MatrixCell() for m in ("dflash", "plain", "fixed-7", "fixed-15", "tree")
    }
    for mode, tokens in (("dflash", 30), ("plain", 15), ("fixed-7", 25), ("fixed-15", 32),
                         ("tree", 24)):  # fmt: skip
        cells[(mode, "s", 1)].add([_out(tokens, 1.0)], ["greedy"], 1.0)
        cells[(mode, "s", 1)].add([_out(tokens, 1.0)], ["greedy"], 2.0 if mode == "tree" else 1.0)
    (row,) = sm.matrix_rows(cells, [shape], [1])
    assert row["vs_fixed"] == pytest.approx({"fixed-7": 1.2, "fixed-15": 30 / 32})
    assert row["vs_best_fixed"] == pytest.approx(30 / 32)
    assert row["vs_tree"] == pytest.approx(30 / 16)
    assert row["vs_tree_per_round"] == pytest.approx([30 / 24, 30 / 12])  # 24 then 12 tok/s
    assert row["tree_ratio"] == pytest.approx(16 / 15)
    summary = sm.summary([row])
    assert summary["worst_vs_best_fixed_c1"] == pytest.approx(30 / 32)
    assert summary["worst_vs_tree"] == pytest.approx(30 / 16)
    table = sm.format_matrix({"results": [row], "summary": summary})
    assert "vs best fixed k >= 0.94; every cell: vs --tree >= 1.88" in table
    assert "DFlash/tree" in table and "1.25-2.50" in table  # the tree's table and its rounds


def test_a_tree_checkout_is_compared_in_every_cell_and_fixed_k_only_at_c1() -> None:
    shape = sm.Shape("s", (8, 48), (32, 96), False, "burst", "0")
    cells = {(m, "s", 4): sm.MatrixCell() for m in ("dflash", "plain", "tree")}
    for mode, tokens in (("dflash", 30), ("plain", 20), ("tree", 40)):
        cells[(mode, "s", 4)].add([_out(tokens, 1.0)], ["greedy"], 1.0)
    (row,) = sm.matrix_rows(cells, [shape], [4])
    assert "vs_fixed" not in row and "vs_best_fixed" not in row
    assert row["vs_tree"] == pytest.approx(0.75) and row["tree_ratio"] == pytest.approx(2.0)
    args = sb.parse_args(["--matrix", "--fixed", "7", "--tree", str(bb.REPO)])
    assert sm.modes(args) == ["dflash", "plain", "fixed-7", "tree"]


def test_a_control_worker_reports_the_bench_own_scatter() -> None:
    shape = sm.Shape("s", (8, 48), (32, 96), False, "closed", "0.7")
    cells = {(m, "s", c): sm.MatrixCell() for m in ("dflash", "plain", "control") for c in (1, 2)}
    for c, control in ((1, 19), (2, 21)):
        for mode, tokens in (("dflash", 20), ("plain", 20), ("control", control)):
            cells[(mode, "s", c)].add([_out(tokens, 1.0)], ["sampled"], 1.0)
    rows = sm.matrix_rows(cells, [shape], [1, 2])
    assert [r["control_ratio"] for r in rows] == pytest.approx([0.95, 1.05])
    assert all("vs_fixed" not in r for r in rows)  # the control is no fixed-k rival
    summary = sm.summary(rows)
    assert summary["control_range"] == pytest.approx([0.95, 1.05])
    assert summary["control_cells_below_0.98"] == 1
    table = sm.format_matrix({"results": rows, "summary": summary})
    assert "A/A (a second plain worker over plain, every cell): 0.95-1.05, 1 of 2" in table
    assert sm.summary(rows[:0])["control_range"] is None


def test_a_dflash2_worker_is_compared_with_plain_and_with_dflash_in_every_cell() -> None:
    shape = sm.Shape("s", (8, 48), (32, 96), False, "closed", "0")
    cells = {(m, "s", c): sm.MatrixCell() for m in ("dflash", "plain", "dflash2") for c in (1, 2)}
    for c, (fast, second) in ((1, (30, 36)), (2, (24, 21))):
        for mode, tokens in (("dflash", fast), ("plain", 20), ("dflash2", second)):
            cells[(mode, "s", c)].add([_out(tokens, 1.0)], ["greedy"], 1.0)
    rows = sm.matrix_rows(cells, [shape], [1, 2])
    assert [r["dflash2_ratio"] for r in rows] == pytest.approx([1.8, 1.05])
    assert [r["dflash2_vs_dflash"] for r in rows] == pytest.approx([1.2, 21 / 24])
    assert all("vs_fixed" not in r for r in rows)  # DFlash2 runs in every cell: no c=1 rival
    summary = sm.summary(rows)
    assert summary["dflash2_worst_ratio"] == pytest.approx(1.05)
    assert summary["dflash2_worst_cell"] == "s c=2" and summary["worst_ratio"] == pytest.approx(1.2)
    assert summary["dflash2_vs_dflash_range"] == pytest.approx([21 / 24, 1.2])
    table = sm.format_matrix({"results": rows, "summary": summary})
    assert "DFlash2 worst cell: 1.05 (s c=2) against DFlash's 1.20 (s c=2)" in table
    assert sm.summary(rows[:0])["dflash2_worst_ratio"] is None
    assert "DFlash2 worst" not in sm.format_matrix({"results": [], "summary": sm.summary([])})


def test_a_cell_interleaves_the_workers_batch_by_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each worker serves the same batches; the order changes from batch to batch (and from
    round to round), so a slow spell of the machine is shared rather than one worker's."""
    calls: list[tuple[str, str]] = []

    async def run(
        client: object, url: str, shape: sm.Shape, batch: list[sb.Request], c: int
    ) -> tuple[list[sb.Outcome | None], float]:
        calls.append((url, batch[0].prompt))
        return [_out(10, 0.5)] * len(batch), 0.5

    async def quiet(workers: object) -> float:
        return 0.0

    async def seconds(client: object, url: str) -> dict[str, float]:
        return dict.fromkeys(sm.KINDS, float(len(calls)))

    monkeypatch.setattr(sm, "_run", run)
    monkeypatch.setattr(sm, "settle", quiet)
    monkeypatch.setattr(sm, "step_seconds", seconds)
    process: Any = None  # never started: `_run` is replaced
    workers = [bb.RunningWorker(bb.WorkerSpec("embedded", m), m, process, Path()) for m in "ab"]
    burst = next(s for s in sm.SHAPES if s.arrivals == "burst")
    args = sb.parse_args(["--matrix", "--concurrency", "1", "--min-requests", "3"])
    requests = [sb.Request("chat", f"p{i}", 8, 32) for i in range(3)]
    cells = {(m, burst.name, 1): sm.MatrixCell() for m in ("a", "b")}
    client: Any = None  # never used: every call that takes it is replaced
    for r in range(2):
        asyncio.run(sm._measure_cell(client, workers, cells, requests, burst, 1, r, args))
    assert calls == [
        ("a", "p0"), ("b", "p0"), ("b", "p1"), ("a", "p1"), ("a", "p2"), ("b", "p2"),  # round 1
        ("b", "p0"), ("a", "p0"), ("a", "p1"), ("b", "p1"), ("b", "p2"), ("a", "p2"),  # round 2
    ]  # fmt: skip
    for m in ("a", "b"):
        cell = cells[(m, burst.name, 1)]
        assert cell.rounds == [20.0, 20.0] and cell.tokens == 60  # one entry per round
        assert cell.profile["prefill"] == 6  # each batch's own before/after, summed


def test_restarts_start_the_workers_afresh_each_round_in_alternating_order(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`--restarts`: every round runs on workers started for it, in the reverse order every
    other round, and every cell gathers one reading per round across them; `--together`
    starts each round's workers at the same moment."""
    starts: list[list[str]] = []
    together: list[object] = []

    @contextlib.contextmanager
    def launch(specs: list[bb.WorkerSpec], *args: object, **kwargs: object) -> Iterator[Any]:
        starts.append([s.mode for s in specs])
        together.append(kwargs.get("together"))
        process: Any = None  # never started: `_run` is replaced
        yield [bb.RunningWorker(s, s.mode, process, Path()) for s in specs]

    async def run(
        client: object, url: str, shape: sm.Shape, batch: list[sb.Request], c: int
    ) -> tuple[list[sb.Outcome | None], float]:
        return [_out(10, 0.5)] * len(batch), 0.5

    async def quiet(workers: object) -> float:
        return 0.0

    async def seconds(client: object, url: str) -> dict[str, float]:
        return dict.fromkeys(sm.KINDS, 0.0)

    monkeypatch.setattr(sm, "running_workers", launch)
    monkeypatch.setattr(sm, "_run", run)
    monkeypatch.setattr(sm, "settle", quiet)
    monkeypatch.setattr(sm, "step_seconds", seconds)
    argv = ["--matrix", "--restarts", "--rounds", "3", "--concurrency", "1"]
    args = sb.parse_args([*argv, "--shapes", "short-burst-t0", "--fixed", "7"])
    specs = [bb.WorkerSpec("embedded", m) for m in sm.modes(args)]
    requests = sm.workloads(args)
    cells = sm.measure_started(specs, requests, args, tmp_path, bb.worker_env, lambda s: tmp_path)
    forward = ["dflash", "plain", "fixed-7"]
    assert starts == [forward, forward[::-1], forward]
    assert {mode for mode, _, _ in cells} == set(forward)
    assert all(len(cell.rounds) == 3 for cell in cells.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round-1", "round-2", "round-3"]
    assert together == [False] * 3  # one at a time, unless --together
    args = sb.parse_args([*argv, "--shapes", "short-burst-t0", "--together"])
    sm.measure_started(specs, requests, args, tmp_path / "t", bb.worker_env, lambda s: tmp_path)
    assert together[3:] == [True] * 3
    for matrix_only in ("--restarts", "--together"):
        with pytest.raises(SystemExit):
            sb.parse_args([matrix_only])


def test_matrix_options() -> None:
    args = sb.parse_args(["--matrix"])
    assert args.max_model_len == sm.MAX_MODEL_LEN and args.requests_per_slot == 3
    assert sb.parse_args([]).max_model_len == 1024
    with pytest.raises(SystemExit):  # the long prompts and answers would not fit
        sb.parse_args(["--matrix", "--max-model-len", "1024"])
    assert sm.modes(sb.parse_args(["--matrix", "--fixed", "7,15", "--tree", str(bb.REPO)])) == [
        "dflash", "plain", "fixed-7", "fixed-15", "tree"
    ]  # fmt: skip
    reverse = sb.parse_args(["--matrix", "--control", "--fixed", "7", "--reverse-starts"])
    assert sm.modes(reverse) == ["fixed-7", "control", "plain", "dflash"]
    with_control = sb.parse_args(["--matrix", "--control", "--fixed", "7"])
    assert sm.modes(with_control) == ["dflash", "plain", "control", "fixed-7"]
    control = sb.worker_argv(bb.WorkerSpec("embedded", "control"), 0, with_control)
    assert control[-1] == "--no-speculation"  # a second plain worker, as the first
    with_dflash2 = sb.parse_args(["--matrix", "--control", "--dflash2", "--fixed", "7"])
    assert sm.modes(with_dflash2) == ["dflash", "plain", "control", "dflash2", "fixed-7"]
    second = sb.worker_argv(bb.WorkerSpec("embedded", "dflash2"), 0, with_dflash2)
    config = json.loads(second[second.index("--speculative-config") + 1])
    assert config == {"method": "dflash2", "model": str(BUNDLED_DFLASH2)}
    assert "--speculation" not in second  # the worker's default (adaptive), as DFlash's
    bad_ones = (
        ["--fixed", "7"],
        ["--control"],
        ["--dflash2"],
        ["--reverse-starts"],
        ["--matrix", "--tree", "/none"],
    )
    for bad in bad_ones:
        with pytest.raises(SystemExit):
            sb.parse_args(bad)


def test_quick_matrix_against_embedded_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(bb.REPO))
    out = tmp_path / "matrix.json"
    argv = ["speedup", "--matrix", "--quick", "--fixed", "3", "--tree", str(bb.REPO), "--control"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    assert "worst cell:" in capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [(r["shape"], r["concurrency"]) for r in rows] == [
        (s.name, c) for s in sm.QUICK_SHAPES for c in (1, 2)
    ]
    for r in rows:
        assert r["errors"] == 0 and r["ratio"] is not None and r["ratio"] > 0
    mixed = [r for r in rows if r["shape"] == "quick-mixed"]
    assert all(r["sampled_vs_plain"] and r["greedy_vs_greedy_only"] for r in mixed)
    assert report["summary"]["cells"] == 4
    c1 = [r for r in rows if r["concurrency"] == 1]  # the fixed-k workers ran at c=1 only
    assert all(r["vs_best_fixed"] for r in c1)
    assert all("vs_fixed" not in r for r in rows if r["concurrency"] == 2)
    assert all(r["vs_tree"] and r["tree_ratio"] for r in rows)  # the tree: in every cell
    controls = [r["control_ratio"] for r in rows]  # the second plain worker: every cell
    assert all(v > 0 for v in controls)
    assert report["summary"]["control_range"] == [min(controls), max(controls)]
    shares = [r["profile"]["dflash"] for r in rows]  # where DFlash's time went
    assert all(s["prefill"] > 0 and s["drafting"] + s["plain"] > 0 for s in shares)


def test_shapes_picks_some_with_their_twins() -> None:
    args = sb.parse_args(["--matrix", "--shapes", "short-burst-mixed-seeded,long-burst-t0"])
    names = [s.name for s in sm.shapes_for(args)]
    assert names == ["short-burst-t0", "short-burst-mixed-seeded", "long-burst-t0"]
    with pytest.raises(SystemExit):
        sm.shapes_for(sb.parse_args(["--matrix", "--shapes", "nope"]))
    with pytest.raises(SystemExit):
        sb.parse_args(["--shapes", "long-burst-t0"])  # a --matrix option
