"""`dflash-bench fleet --quick` as CI runs it: two real embedded workers behind two real
gateways; the JSON's structure, the static splits really routed as pinned, every routing
answered without error (never its speed: that is the full benchmark's, loadtest/RESULTS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loadtest.fleet_bench import CLASSES, STATIC, judge, request_body, stream_prompts

REPO = Path(__file__).resolve().parents[2]


def test_the_stream_interleaves_greedy_and_sampled_requests() -> None:
    prompts = stream_prompts()
    assert len(prompts) >= 8
    bodies = [request_body(i, prompts, 16) for i in range(4)]
    assert [b["temperature"] for b in bodies] == [0.0, 1.0, 0.0, 1.0]
    assert len({b["messages"][0]["content"] for b in bodies}) == 4


def test_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    run = subprocess.run(
        [sys.executable, "-m", "loadtest.bench", "fleet", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    cells = row["cells"]
    assert set(cells) == {*STATIC, "by class", "fastest"}
    assert all(cell["errors"] == 0 and cell["requests"] >= 4 for cell in cells.values())
    assert cells["dflash"]["pool_shares"] == {"dflash": 1.0}  # pinned 100/0
    assert cells["plain"]["pool_shares"] == {"plain": 1.0}  # pinned 0/100
    assert set(cells["50/50"]["pool_shares"]) == {"dflash", "plain"}
    assert cells["by class"]["pool_shares"] == {"direct": 1.0}  # the client's own split
    assert set(row["class_over_best"]) == set(CLASSES)
    assert row["best_static"] in {*STATIC, "by class"}
    assert "fastest/best" in run.stdout


def test_the_goal_is_judged_against_the_best_static_split() -> None:
    from loadtest.fleet_bench import Cell, Served

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
