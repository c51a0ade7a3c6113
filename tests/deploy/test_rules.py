"""Alert rules: promtool checks them, promtool unit tests cover every alert (firing and
silent), and the chart's PrometheusRule is exactly rules/alerts.yaml."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.chart import RULES_FILE, RULES_TEST_FILE, rendered_rule_groups

pytestmark = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool missing: run `make tools`"
)


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["promtool", *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False
    )


def alert_names() -> list[str]:
    data = yaml.safe_load(RULES_FILE.read_text())
    return [r["alert"] for g in data["groups"] for r in g["rules"] if "alert" in r]


def test_promtool_check_rules() -> None:
    proc = promtool("check", "rules", str(RULES_FILE))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_promtool_unit_tests_pass() -> None:
    proc = promtool("test", "rules", RULES_TEST_FILE.name, cwd=RULES_TEST_FILE.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_every_alert_has_a_firing_and_a_silent_unit_test() -> None:
    tests = yaml.safe_load(RULES_TEST_FILE.read_text())["tests"]
    cases = [c for t in tests for c in t.get("alert_rule_test", [])]
    firing = {c["alertname"] for c in cases if c.get("exp_alerts")}
    silent = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    assert len(alert_names()) >= 9
    assert set(alert_names()) == firing
    assert set(alert_names()) <= silent


def test_a_broken_expectation_fails(tmp_path: Path) -> None:
    # The unit tests compare labels and annotations exactly: prove a wrong one fails.
    tests = yaml.safe_load(RULES_TEST_FILE.read_text())
    tests["tests"] = [t for t in tests["tests"] if "mismatch" in yaml.safe_dump(t)]
    text = yaml.safe_dump(tests).replace("severity: critical", "severity: warning")
    (tmp_path / "alerts.yaml").write_text(RULES_FILE.read_text())
    (tmp_path / "t.yaml").write_text(text)
    proc = promtool("test", "rules", "t.yaml", cwd=tmp_path)
    assert proc.returncode != 0
    assert "DFlashDraftAcceptanceNearZero" in proc.stdout + proc.stderr


def test_chart_rule_file_is_the_default_rendering() -> None:
    # Regenerate with `.venv/bin/python -m tests.deploy.chart` after editing _alerts.tpl.
    assert yaml.safe_load(RULES_FILE.read_text()) == rendered_rule_groups()


def test_thresholds_come_from_values(tmp_path: Path) -> None:
    spec = rendered_rule_groups(
        ("monitoring.alerts.queueBacklog=7", "monitoring.alerts.acceptanceLengthMin=3")
    )
    rules = {r.get("alert"): r for g in spec["groups"] for r in g["rules"]}
    assert rules["DFlashQueueBacklog"]["expr"] == "vllm:num_requests_waiting > 7"
    assert rules["DFlashAcceptanceLengthLow"]["expr"].endswith("< 3")
    path = tmp_path / "custom.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = promtool("check", "rules", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
