"""Render the Helm chart with the real helm binary; regenerate the rule files.

`python -m tests.deploy.chart` rewrites helm/dflash-serving/rules/alerts.yaml and
rules/cluster.yaml from templates/_alerts.tpl, rendered with the default values and the compose
stack's job names as selectors (a test keeps them identical). alerts.yaml reads only the
components' own metrics (the compose stack and the end-to-end test load it); cluster.yaml reads
`up`, kube-state-metrics and vLLM-only counters.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "dflash-serving"
RULES_FILE = CHART / "rules" / "alerts.yaml"
CLUSTER_RULES_FILE = CHART / "rules" / "cluster.yaml"
RULES_TEST_FILE = CHART / "rules" / "alerts_test.yaml"
CLUSTER_GROUP = "dflash-serving.cluster"
# docker/prometheus.yml's job names, without the namespace a Kubernetes Prometheus adds.
COMPOSE_SELECTORS = (
    'monitoring.alerts.gatewaySelector="job=\\"gateway\\""',
    'monitoring.alerts.workerSelector="job=\\"worker\\""',
)
DASHBOARD_FILE = CHART / "dashboards" / "dflash-serving.json"
# chart-testing's convention: every file here is rendered, linted and validated by the tests.
CI_VALUES = tuple(sorted(f"ci/{p.name}" for p in (CHART / "ci").glob("*-values.yaml")))
MONITORING_APIS = (
    "monitoring.coreos.com/v1/ServiceMonitor",
    "monitoring.coreos.com/v1/PodMonitor",
    "monitoring.coreos.com/v1/PrometheusRule",
)
RULES_HEADER = (
    "# Generated from templates/_alerts.tpl with the chart's default values; do not edit.\n"
    "# Regenerate: .venv/bin/python -m tests.deploy.chart\n"
)


def helm_binary() -> str:
    """The helm that `make tools` installs, else one on PATH."""
    local = ROOT / ".tools" / "bin" / "helm"
    if local.exists():
        return str(local)
    found = shutil.which("helm")
    if found is None:
        raise FileNotFoundError("helm not found: run `make tools`")
    return found


def helm(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "HELM_CACHE_HOME": "/tmp/dflash-helm-cache",
        "HELM_CONFIG_HOME": "/tmp/dflash-helm-config",
        "HELM_DATA_HOME": "/tmp/dflash-helm-data",
    }
    return subprocess.run(
        [helm_binary(), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
        cwd=cwd,
    )


def template_args(
    values: tuple[str, ...] = (),
    sets: tuple[str, ...] = (),
    api_versions: tuple[str, ...] = (),
    set_json: tuple[str, ...] = (),
) -> list[str]:
    args = ["template", "rel", str(CHART), "--namespace", "llm"]
    for name in values:
        args += ["-f", str(CHART / name)]
    for item in sets:
        args += ["--set", item]
    for item in set_json:
        args += ["--set-json", item]
    for api in api_versions:
        args += ["--api-versions", api]
    return args


def render(
    values: tuple[str, ...] = (),
    sets: tuple[str, ...] = (),
    api_versions: tuple[str, ...] = (),
    set_json: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """Every object `helm template` renders (release "rel", namespace "llm"), parsed."""
    proc = helm(*template_args(values, sets, api_versions, set_json))
    if proc.returncode != 0:
        raise RuntimeError(f"helm template failed: {proc.stderr}")
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def find(docs: list[dict[str, Any]], kind: str, suffix: str = "") -> dict[str, Any]:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    assert len(hits) == 1, (
        f"expected one {kind} *{suffix}, got {[h['metadata']['name'] for h in hits]}"
    )
    return hits[0]


def rendered_rule_groups(
    sets: tuple[str, ...] = (), set_json: tuple[str, ...] = COMPOSE_SELECTORS
) -> dict[str, Any]:
    """The PrometheusRule's spec ({"groups": [...]}), by default with the compose selectors."""
    docs = render(sets=("monitoring.prometheusRule.enabled=true", *sets), set_json=set_json)
    spec: dict[str, Any] = find(docs, "PrometheusRule")["spec"]
    return spec


def split_rule_groups(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(alerts.yaml, cluster.yaml) contents of one rendering."""
    groups = spec["groups"]
    own = [g for g in groups if g["name"] != CLUSTER_GROUP]
    cluster = [g for g in groups if g["name"] == CLUSTER_GROUP]
    return {"groups": own}, {"groups": cluster}


def dump_rules(data: dict[str, Any]) -> str:
    return RULES_HEADER + yaml.safe_dump(data, sort_keys=False, width=1000, allow_unicode=True)


def write_rules_files() -> None:
    own, cluster = split_rule_groups(rendered_rule_groups())
    RULES_FILE.write_text(dump_rules(own), encoding="utf-8")
    CLUSTER_RULES_FILE.write_text(dump_rules(cluster), encoding="utf-8")


if __name__ == "__main__":
    write_rules_files()
    print(f"wrote {RULES_FILE} and {CLUSTER_RULES_FILE}")
