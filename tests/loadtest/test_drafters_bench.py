"""`dflash-bench drafters --quick` as CI runs it: both bundled drafters served, the same
greedy text from both, the report's structure (never its speed: loadtest/RESULTS.md)."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.bench import main as bench_main


def test_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "drafters.json"
    assert bench_main(["drafters", "--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["drafters"]) == {"dflash", "dflash2"}
    assert report["same_greedy_text"] is True
    assert all(
        row["requests"] == 2 and row["tokens_per_s"] > 0 for row in report["drafters"].values()
    )
    assert report["dflash2_over_dflash"] > 0
