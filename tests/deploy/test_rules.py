"""Alert rules: promtool checks them, promtool unit tests cover every alert (firing and
silent), the chart's PrometheusRule is exactly rules/alerts.yaml + rules/cluster.yaml, and the
rules the chart installs are scoped to the release's namespace and jobs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.chart import (
    CLUSTER_RULES_FILE,
    RULES_FILE,
    RULES_TEST_FILE,
    dump_rules,
    rendered_rule_groups,
    split_rule_groups,
)

pytestmark = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool missing: run `make tools`"
)


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["promtool", *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False
    )


def alert_names() -> list[str]:
    names = []
    for path in (RULES_FILE, CLUSTER_RULES_FILE):
        data = yaml.safe_load(path.read_text())
        names += [r["alert"] for g in data["groups"] for r in g["rules"] if "alert" in r]
    return names


def test_promtool_check_rules() -> None:
    proc = promtool("check", "rules", str(RULES_FILE), str(CLUSTER_RULES_FILE))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SUCCESS") == 2


def test_promtool_unit_tests_pass() -> None:
    proc = promtool("test", "rules", RULES_TEST_FILE.name, cwd=RULES_TEST_FILE.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_every_alert_has_a_firing_and_a_silent_unit_test() -> None:
    tests = yaml.safe_load(RULES_TEST_FILE.read_text())["tests"]
    cases = [c for t in tests for c in t.get("alert_rule_test", [])]
    firing = {c["alertname"] for c in cases if c.get("exp_alerts")}
    silent = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    assert len(alert_names()) >= 14
    assert set(alert_names()) == firing
    assert set(alert_names()) <= silent


def test_a_broken_expectation_fails(tmp_path: Path) -> None:
    # The unit tests compare labels and annotations exactly: prove a wrong one fails.
    tests = yaml.safe_load(RULES_TEST_FILE.read_text())
    tests["tests"] = [t for t in tests["tests"] if "DFlashDrafterMismatch" in yaml.safe_dump(t)]
    text = yaml.safe_dump(tests).replace("severity: critical", "severity: warning")
    (tmp_path / "alerts.yaml").write_text(RULES_FILE.read_text())
    (tmp_path / "cluster.yaml").write_text(CLUSTER_RULES_FILE.read_text())
    (tmp_path / "t.yaml").write_text(text)
    proc = promtool("test", "rules", "t.yaml", cwd=tmp_path)
    assert proc.returncode != 0
    assert "DFlashDrafterMismatch" in proc.stdout + proc.stderr


def test_chart_rule_files_are_the_default_rendering() -> None:
    # Regenerate with `.venv/bin/python -m tests.deploy.chart` after editing _alerts.tpl.
    own, cluster = split_rule_groups(rendered_rule_groups())
    assert yaml.safe_load(RULES_FILE.read_text()) == own
    assert yaml.safe_load(CLUSTER_RULES_FILE.read_text()) == cluster


def test_compose_rules_read_only_what_the_components_export() -> None:
    # alerts.yaml is what the compose stack and the CPU end-to-end test load: no `up`, no
    # kube-state-metrics, no vLLM-only counters there.
    text = RULES_FILE.read_text()
    assert "up{" not in text and "kube_" not in text and "num_preemptions" not in text


def test_thresholds_come_from_values(tmp_path: Path) -> None:
    spec = rendered_rule_groups(
        ("monitoring.alerts.queueBacklog=7",),
        (
            "model.speculative.numSpeculativeTokens=3",
            "model.speculative.expectedAcceptanceLength=3.5",
            'monitoring.alerts.workerSelector="job=\\"w\\""',
        ),
    )
    rules = {r.get("alert"): r for g in spec["groups"] for r in g["rules"]}
    assert rules["DFlashQueueBacklog"]["expr"] == 'worker:dflash_requests_waiting:sum{job="w"} > 7'
    # Relative to the drafter's expected length: 0.6 × 3.5 (K = 3 allows at most 4).
    assert rules["DFlashAcceptanceLengthLow"]["expr"].endswith("< 2.1")
    path = tmp_path / "custom.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = promtool("check", "rules", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_chart_rules_are_scoped_to_the_release(tmp_path: Path) -> None:
    """The rules as the chart installs them (release rel in namespace llm, Prometheus
    Operator job names): a vLLM of another release in the same namespace, or of another
    namespace, never fires them; the release's own worker does."""
    own, cluster = split_rule_groups(rendered_rule_groups(set_json=()))
    (tmp_path / "alerts.yaml").write_text(dump_rules(own))
    (tmp_path / "cluster.yaml").write_text(dump_rules(cluster))
    ours = 'namespace="llm",job="llm/rel-dflash-serving-worker"'
    series = [
        (ours, "40x20"),
        ('namespace="llm",job="llm/other-vllm"', "100x20"),
        ('namespace="team-b",job="team-b/rel-dflash-serving-worker"', "100x20"),
    ]
    test = {
        "rule_files": ["alerts.yaml", "cluster.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": f'vllm:num_requests_waiting{{{labels},instance="i"}}', "values": v}
                    for labels, v in series
                ]
                + [  # only foreign workers report running requests
                    {"series": f'vllm:num_requests_running{{{labels},instance="i"}}', "values": v}
                    for labels, v in series[1:]
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "15m",
                        "alertname": "DFlashQueueBacklog",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": "warning",
                                    "namespace": "llm",
                                    "job": "llm/rel-dflash-serving-worker",
                                    "instance": "i",
                                    "engine": "vllm",
                                },
                                "exp_annotations": {
                                    "summary": "Requests are queueing on a worker",
                                    "description": "Worker i has 40 requests waiting (threshold"
                                    " 32); add workers (worker.autoscaling) or lower max"
                                    " concurrency.",
                                },
                            }
                        ],
                    },
                    # Foreign workers' series do not hide that ours report nothing.
                    {
                        "eval_time": "15m",
                        "alertname": "DFlashWorkerMetricsAbsent",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": "critical",
                                    "namespace": "llm",
                                    "job": "llm/rel-dflash-serving-worker",
                                },
                                "exp_annotations": {
                                    "summary": "No DFlash worker reports metrics",
                                    "description": f"No worker series ({ours}) for 10 minutes:"
                                    " every worker is down, pending or still loading its model,"
                                    " or the PodMonitor selects nothing.",
                                },
                            }
                        ],
                    },
                ],
            }
        ],
    }
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(test))
    proc = promtool("test", "rules", "t.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
