"""`dflash-bench fleet --quick` as CI runs it: two real embedded workers behind two real
gateways; the JSON's structure, the static splits really routed as pinned, every routing
answered without error (never its speed: that is the full benchmark's, loadtest/RESULTS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from loadtest.fleet_bench import (
    CLASSES,
    CONTROL,
    STATIC,
    Cell,
    ChoiceLog,
    Served,
    Stream,
    build_parser,
    judge,
    nested,
    stream_prompts,
)

REPO = Path(__file__).resolve().parents[2]


def test_the_interleaved_stream_takes_classes_and_prompts_in_turn() -> None:
    prompts = stream_prompts()
    assert len(prompts) >= 8
    bodies = [Stream(prompts, 16, order="interleaved").body(i) for i in range(4)]
    assert [b["temperature"] for b in bodies] == [0.0, 1.0, 0.0, 1.0]
    assert [b["messages"][0]["content"] for b in bodies] == prompts[:4]
    assert {b["max_tokens"] for b in bodies} == {16}
    quarter = Stream(prompts, greedy_share=0.25, order="interleaved")  # one in four, evenly
    assert [quarter.klass(i) for i in range(8)] == (["greedy"] + ["sampled"] * 3) * 2
    assert [quarter.body(i)["temperature"] for i in range(4)] == [0.0, 1.0, 1.0, 1.0]


def test_the_shuffled_stream_keeps_each_decks_classes_and_prompts_but_not_their_turns() -> None:
    """Interleaved, a request's class and prompt follow its index, and a round robin over two
    pools sent one pool the greedy requests of half the prompts only (Stream). Shuffled, each
    deck of len(prompts) requests holds the same classes and prompts, in orders of its own:
    no prompt keeps one class, and the even requests are no longer one class."""
    prompts = stream_prompts()
    size = len(prompts)
    for share in (0.25, 0.5, 0.75):
        shuffled, interleaved = (
            Stream(prompts, greedy_share=share),
            Stream(prompts, greedy_share=share, order="interleaved"),
        )
        for start in range(0, 8 * size, size):
            decks = [
                [stream.body(i) for i in range(start, start + size)]
                for stream in (shuffled, interleaved)
            ]
            assert [sorted(b["messages"][0]["content"] for b in d) for d in decks] == [
                sorted(prompts)
            ] * 2
            assert sorted(b["temperature"] for b in decks[0]) == sorted(
                b["temperature"] for b in decks[1]
            )
        even = [shuffled.greedy(i) for i in range(0, 16 * size, 2)]
        assert abs(sum(even) / len(even) - share) < 0.1
    half = Stream(prompts)
    pairs = Counter(
        (half.body(i)["messages"][0]["content"], half.klass(i)) for i in range(16 * size)
    )
    assert all(pairs[prompt, klass] for prompt in prompts for klass in CLASSES)
    assert [half.body(i) for i in range(size)] == [Stream(prompts).body(i) for i in range(size)]


def test_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    argv = ["fleet", "--quick", "--rounds", "2", "--control", "--out", str(out)]
    run = subprocess.run(
        [sys.executable, "-m", "loadtest.bench", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    cells = row["cells"]
    assert set(cells) == {*STATIC, "by class", "fastest", CONTROL}
    assert all(cell["errors"] == 0 and cell["requests"] >= 4 for cell in cells.values())
    assert cells["dflash"]["pool_shares"] == {"dflash": 1.0}  # pinned 100/0
    assert cells["plain"]["pool_shares"] == {"plain": 1.0}  # pinned 0/100
    assert set(cells["50/50"]["pool_shares"]) == {"dflash", "plain"}
    # The client's own split, through a gateway per pool: greedy to DFlash, sampled to plain.
    greedy = sum(Stream(stream_prompts()).greedy(i) for i in range(4)) / 4
    shares = {"dflash": greedy, "plain": 1 - greedy}
    assert cells["by class"]["pool_shares"] == {p: s for p, s in shares.items() if s}
    by_class = {"greedy": {"dflash": 1.0}, "sampled": {"plain": 1.0}}
    assert cells["by class"]["class_pool_shares"] == by_class
    assert cells[CONTROL]["class_pool_shares"] == by_class  # the A/A: the same split again
    assert row["control_over_by_class"] > 0
    assert cells["dflash"]["class_pool_shares"] == {k: {"dflash": 1.0} for k in CLASSES}
    assert set(row["class_over_best"]) == set(CLASSES)
    assert row["best_static"] in {*STATIC, "by class"}
    assert "fastest/best" in run.stdout and "A/A" in run.stdout
    # Why fastest sent each measured request where it did, from its own log: one choice each.
    chosen = row["fastest_choices"]
    counted = sum(n for pools in chosen.values() for why in pools.values() for n in why.values())
    assert counted == cells["fastest"]["requests"]
    assert {klass.split("/")[0] for klass in chosen} == set(CLASSES)


def test_rounds_add_up_into_one_cell_per_routing() -> None:
    """--rounds: each routing's chunks, interleaved with the others', judged as one cell."""
    first = Cell(wall_s=2.0, served=[Served(64, 0.5, "greedy", "dflash")])
    first.add(Cell(wall_s=1.0, served=[Served(32, 0.25, "sampled", "plain")], errors=1))
    assert first.wall_s == 3.0 and first.errors == 1 and len(first.served) == 2
    assert first.tokens_per_s == 32.0 and first.shares() == {"dflash": 0.5, "plain": 0.5}
    assert first.shares("greedy") == {"dflash": 1.0} and first.shares("sampled") == {"plain": 1.0}


def test_the_goal_is_judged_against_the_best_static_split() -> None:
    def cell(greedy: float, sampled: float) -> Cell:
        served = [
            Served(int(greedy), 1.0, "greedy", "x"),
            Served(int(sampled), 1.0, "sampled", "x"),
        ]
        return Cell(wall_s=1.0, served=served)

    cells = {"dflash": cell(100, 20), "plain": cell(50, 40), "fastest": cell(100, 38)}
    row = judge(4, cells)
    assert row["best_static"] == "dflash" and row["fastest_over_best"] == round(138 / 120, 3)
    assert row["met"]
    slow_class = judge(4, {**cells, "fastest": cell(200, 10)})
    assert not slow_class["met"]  # sampled at 0.5x of the best split's
    assert row["control_over_by_class"] is None  # no --control


def test_the_control_is_no_candidate_for_the_best_static_split() -> None:
    """The split by class run twice: the second run reads its resolution, and is never the
    split fastest is judged against (the better of two noisy readings of one routing)."""

    def cell(tokens: int) -> Cell:
        return Cell(wall_s=1.0, served=[Served(tokens, 1.0, "greedy", "x")])

    cells = {"by class": cell(100), CONTROL: cell(104), "fastest": cell(101)}
    row = judge(1, cells)
    assert row["best_static"] == "by class" and row["fastest_over_best"] == 1.01
    assert row["control_over_by_class"] == 1.04 and row["met"]


def test_the_mix_and_the_control_are_options() -> None:
    args = build_parser().parse_args(["--greedy-share", "0.25", "--control"])
    assert args.greedy_share == 0.25 and args.control
    default = build_parser().parse_args([])
    assert default.greedy_share == 0.5 and not default.control
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--greedy-share", "1"])  # the split by class needs both


def test_fastest_s_choices_are_read_from_its_log_by_span(tmp_path: Path) -> None:
    """Each cell counts the choices logged while it ran, by class, pool and reason; other
    loggers' lines and lines before the mark are not counted."""
    log = ChoiceLog(tmp_path / "fastest.log")
    assert log.mark() == 0
    prefix = "2026-11-30 12:00:00,000 DEBUG dflash.gateway.fastest: "
    log.path.write_text(prefix + "greedy/short to dflash: by weights, no estimate on every pool\n")
    mark = log.mark()
    with log.path.open("a") as out:
        out.write(prefix + "greedy/short to dflash: dflash at 2 in flight: 90 tokens/s, ...\n")
        out.write(
            prefix + "sampled/short to dflash (no lean: every pool away from home mixed): x\n"
        )
        out.write(prefix + "sampled/short to plain: exploring onto an idle worker\n")
        out.write(prefix + "sampled/short to plain: plain at 1 in flight: 80 tokens/s, ...\n")
        out.write(prefix + "greedy/short to plain: exploring onto a pool no busier than its pick\n")
        out.write("2026-11-30 12:00:00,000 WARNING dflash.gateway.fleet: a worker is down\n")
    assert nested(log.counts(mark)) == {
        "greedy/short": {"dflash": {"rule": 1}, "plain": {"exploring under load": 1}},
        "sampled/short": {"dflash": {"rule, no lean": 1}, "plain": {"exploring": 1, "rule": 1}},
    }
    assert nested(log.counts(0))["greedy/short"]["dflash"] == {"by weights": 1, "rule": 1}
