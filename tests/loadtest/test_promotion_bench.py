"""`dflash-bench promotion` (loadtest/promotion_bench.py): the quick run on live embedded
workers, and its verdicts on recorded rows (never its speed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import bench
from loadtest.promotion_bench import Scenario, pools_file, table


def test_quick_run_drives_a_canary_rollout_through_a_real_gateway(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "promotion.json"
    argv = ["promotion", "--quick", "--scenarios", "worse", "--out", str(out)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    assert any(line.startswith("worse ") and "| plain" in line for line in printed)
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert (row["scenario"], row["baseline"], row["canary"]) == ("worse", "dflash", "plain")
    assert row["requests"] == 6 and row["errors"] == 0
    # Six requests are far fewer than a stage's 50 samples: the rollout is still testing,
    # at its first stage, and the table reads the live /admin/pools.
    assert row["status"] == "testing" and row["weights"] == {"base": 90.0, "canary": 10.0}
    assert row["moves"] == [[3, 10.0]] and row["met"] is False


def test_verdicts_and_the_pools_file(tmp_path: Path) -> None:
    better = Scenario("better", requests=1400, status="promoted", moves=[(10, 10.0), (700, 25.0)])
    late = Scenario("worse", requests=1200, status="rolled_back")
    identical = Scenario("identical", requests=2000, status="testing")
    turned_on = Scenario("speculation-on", requests=2000, status="testing")
    rows = [s.row() for s in (better, late, identical, turned_on)]
    assert [r["met"] for r in rows] == [True, False, None, False]  # worse: rolled back too late
    assert (rows[3]["baseline"], rows[3]["canary"]) == ("plain", "dflash")
    assert Scenario("better", requests=900, status="promoted", errors=1).row()["met"] is False
    printed = table(rows)
    assert "promoted within 2000: met" in printed and "rolled_back within 1000: NOT met" in printed
    assert "10@10 25@700" in printed
    pools = json.loads(pools_file(tmp_path / "p.json", "http://b", "http://c").read_text())
    assert [p["name"] for p in pools] == ["base", "canary"]
    assert pools[1]["promotion"] == {"baseline": "base"} and "weight" not in pools[1]


def test_an_unknown_scenario_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["promotion", "--scenarios", "faster"]) == 2
    assert "no scenario ['faster']" in capsys.readouterr().err
