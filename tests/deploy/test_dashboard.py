"""The Grafana dashboard and the monitoring objects: every query parses (promtool), reads
only metrics ARCHITECTURE.md promises, and the panels the runbook needs are there."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.chart import DASHBOARD_FILE, MONITORING_APIS, RULES_FILE, find, render
from tests.deploy.promql import (
    as_rule_file,
    dashboard_targets,
    exposition_names,
    metric_names,
    recorded_names,
    rule_exprs,
)
from tests.fixtures.engine_expositions import EXPOSITIONS

# ARCHITECTURE.md: the worker wire contract and the gateway's metrics; histograms expose
# _bucket/_sum/_count.
_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "dflash_request_duration_seconds",
    "dflash_time_to_first_token_seconds",
    "dflash_time_per_output_token_seconds",
    "dflash_spec_acceptance_length",
    "dflash_spec_draft_acceptance_rate",
}
_PLAIN = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "dflash_requests_total",
    "dflash_requests_in_flight",
    "dflash_prompt_tokens_total",
    "dflash_completion_tokens_total",
    "dflash_spec_steps_total",
    "dflash_spec_draft_tokens_total",
    "dflash_spec_accepted_tokens_total",
    "dflash_worker_healthy",
    "dflash_upstream_errors_total",
    "dflash_retries_total",
    "dflash_gateway_errors_total",
    "dflash_pool_weight",
    "dflash_pool_gpus_per_worker",
    "dflash_tenant_requests_total",
    "dflash_tenant_prompt_tokens_total",
    "dflash_tenant_completion_tokens_total",
    "dflash_tenant_rate_limited_total",
    "dflash_tenant_limit",
    "dflash_rate_limit_store_errors_total",
}
PROMISED_METRICS = _PLAIN | {h + s for h in _HISTOGRAMS for s in ("_bucket", "_sum", "_count")}
# SGLang's and TensorRT-LLM's own series, which the recording rules map to common names.
ENGINE_METRICS = {name for render in EXPOSITIONS.values() for name in exposition_names(render(1))}


def dashboard() -> dict:  # type: ignore[type-arg]
    data: dict = json.loads(DASHBOARD_FILE.read_text())  # type: ignore[type-arg]
    return data


def used_metric_names() -> set[str]:
    names: set[str] = set()
    for _, expr in dashboard_targets(DASHBOARD_FILE) + rule_exprs(RULES_FILE):
        names |= metric_names(expr)
    return names - recorded_names(RULES_FILE)


def test_metric_name_lexer() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, model) (rate(a_bucket{model=~"$model", '
        'x="sum(y)"}[$__rate_interval]))) / on (model) group_left b:c offset 5m'
    )
    assert metric_names(expr) == {"a_bucket", "b:c"}


def test_queries_use_only_designed_metric_names() -> None:
    used = used_metric_names()
    assert used <= PROMISED_METRICS | ENGINE_METRICS, used - PROMISED_METRICS - ENGINE_METRICS
    # The required views are really there, for every engine.
    assert {
        "dflash_spec_acceptance_length_bucket",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "vllm:kv_cache_usage_perc",
        "sglang:token_usage",
        "trtllm_kv_cache_utilization",
        "trtllm_spec_decode_accepted_tokens_total",
        "dflash_worker_healthy",
    } <= used


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing: run `make tools`")
def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    exprs = [expr for _, expr in dashboard_targets(DASHBOARD_FILE)]
    assert len(exprs) >= 30
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(as_rule_file(exprs))
    proc = subprocess.run(
        ["promtool", "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(exprs)} rules found" in proc.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(as_rule_file(["sum(rate(x[5m])"]))  # the check can fail
    assert (
        subprocess.run(
            ["promtool", "check", "rules", str(bad)], capture_output=True, timeout=60, check=False
        ).returncode
        != 0
    )


def test_panels_cover_the_runbook() -> None:
    panels = {p["title"]: p for p in dashboard()["panels"]}
    wanted = [
        "Acceptance length distribution (per request)",
        "Acceptance length: quantiles and mean",
        "Draft acceptance rate",
        "Acceptance by draft position",
        "Share of output tokens from drafts",
        "Time to first token",
        "Time per output token",
        "End-to-end latency",
        "Tokens per second",
        "Requests in flight and waiting",
        "KV cache usage",
        "Errors by kind",
        "Worker health",
    ]
    assert [w for w in wanted if w not in panels] == []
    heat = panels["Acceptance length distribution (per request)"]
    assert heat["type"] == "heatmap" and heat["targets"][0]["format"] == "heatmap"
    assert "position" in panels["Acceptance by draft position"]["targets"][0]["expr"]
    ids = [p["id"] for p in dashboard()["panels"]]
    assert len(ids) == len(set(ids))


def test_variables_for_model_and_worker() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert "dflash_requests_total" in variables["model"]["definition"]
    assert "worker:dflash_requests_running:sum" in variables["worker"]["definition"]
    for _, expr in dashboard_targets(DASHBOARD_FILE):
        # Worker panels read the engine-neutral recorded series only, never one engine's own.
        assert not any(prefix in expr for prefix in ("vllm:", "sglang:", "trtllm_")), expr
        if "worker:dflash_" in expr:  # per worker pod
            assert 'instance=~"$worker"' in expr and 'model_name=~"$model"' in expr, expr
        elif "engine:dflash_worker_" in expr:  # latency quantiles per engine and model
            assert 'model_name=~"$model"' in expr, expr
        elif not any(
            # per-worker series, and refusals made before a model is known
            name in expr
            for name in (
                "dflash_worker_healthy",
                "dflash_upstream_errors",
                "dflash_gateway_errors",
                "dflash_rate_limit_store_errors",  # the store's, not a model's
            )
        ):
            assert 'model=~"$model"' in expr, expr


def test_every_query_is_scoped_to_one_release() -> None:
    """Two releases serving one model name (loadtest/README.md suggests exactly that) are
    never summed: gateway series are scoped by namespace and job, worker series by namespace
    (and pod instance)."""
    variables = [v["name"] for v in dashboard()["templating"]["list"]]
    assert variables[:3] == ["datasource", "namespace", "job"]
    for _, expr in dashboard_targets(DASHBOARD_FILE):
        for selector in expr.split("{")[1:]:
            assert 'namespace=~"$namespace"' in selector, expr
        if not any(worker in expr for worker in ("worker:dflash_", "engine:dflash_worker_")):
            assert 'job=~"$job"' in expr, expr


def test_per_user_tokens_per_second_has_an_axis_of_its_own() -> None:
    panel = next(p for p in dashboard()["panels"] if p.get("title") == "Tokens per second")
    per_user = next(t["refId"] for t in panel["targets"] if "TPOT" in t["legendFormat"])
    override = next(
        o for o in panel["fieldConfig"]["overrides"] if o["matcher"]["options"] == per_user
    )
    assert {"id": "custom.axisPlacement", "value": "right"} in override["properties"]


def test_dashboard_configmap_for_the_grafana_sidecar() -> None:
    cm = find(render(), "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["dflash-serving.json"]) == dashboard()
    off = render(sets=("monitoring.grafanaDashboard.enabled=false",))
    assert not [d for d in off if d["metadata"]["name"].endswith("-dashboard")]


@pytest.mark.parametrize(
    ("apis", "sets", "expected"),
    [
        ((), (), set()),
        (MONITORING_APIS, (), {"ServiceMonitor", "PodMonitor", "PrometheusRule"}),
        (
            MONITORING_APIS,
            ("monitoring.serviceMonitor.enabled=false", "monitoring.prometheusRule.enabled=false"),
            set(),
        ),
        ((), ("monitoring.serviceMonitor.enabled=true",), {"ServiceMonitor", "PodMonitor"}),
        ((), ("monitoring.prometheusRule.enabled=true",), {"PrometheusRule"}),
    ],
    ids=["auto-no-crds", "auto-crds", "off", "forced-monitors", "forced-rule"],
)
def test_monitoring_objects_follow_crds_or_flags(
    apis: tuple[str, ...], sets: tuple[str, ...], expected: set[str]
) -> None:
    kinds = {d["kind"] for d in render(sets=sets, api_versions=apis)}
    assert kinds & {"ServiceMonitor", "PodMonitor", "PrometheusRule"} == expected


def test_monitors_select_the_right_pods_and_ports() -> None:
    docs = render(
        sets=("monitoring.serviceMonitor.labels.release=kps",), api_versions=MONITORING_APIS
    )
    sm, pm = find(docs, "ServiceMonitor"), find(docs, "PodMonitor")
    assert sm["metadata"]["labels"]["release"] == "kps"
    gw_svc = find(docs, "Service", "-gateway")
    assert sm["spec"]["selector"]["matchLabels"].items() <= gw_svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in gw_svc["spec"]["ports"]}
    pod = find(docs, "Deployment", "-worker")["spec"]["template"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] in ports
    assert (
        sm["spec"]["endpoints"][0]["path"]
        == pm["spec"]["podMetricsEndpoints"][0]["path"]
        == "/metrics"
    )


def test_alerts_select_the_jobs_the_monitors_create() -> None:
    # The Prometheus Operator names a ServiceMonitor target's job after the Service and a
    # PodMonitor target's job "<namespace>/<podmonitor>": the rules select exactly those.
    docs = render(sets=("monitoring.prometheusRule.enabled=true",), api_versions=MONITORING_APIS)
    rules = yaml.safe_dump(find(docs, "PrometheusRule")["spec"])
    gateway_job = find(docs, "Service", "-gateway")["metadata"]["name"]
    worker_job = "llm/" + find(docs, "PodMonitor")["metadata"]["name"]
    assert f'namespace="llm",job="{gateway_job}"' in rules
    assert f'namespace="llm",job="{worker_job}"' in rules
    for kind in ("ServiceMonitor", "PodMonitor"):
        assert "jobLabel" not in find(docs, kind)["spec"]  # the default job names apply


def test_latency_panels_link_exemplars_to_their_traces() -> None:
    """docs/tracing.md: a traces data source the user picks (Tempo or Jaeger), the latency
    panels' queries ask for exemplars, and an exemplar's trace_id opens its trace there."""
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["traces_backend"]["query"] == "tempo,jaeger"
    assert variables["traces"]["type"] == "datasource"
    assert variables["traces"]["query"] == "$traces_backend"
    latency = [
        p
        for p in dashboard()["panels"]
        if p.get("title") in ("Time to first token", "Time per output token", "End-to-end latency")
    ]
    assert len(latency) == 3
    for panel in latency:
        assert all(t["exemplar"] for t in panel["targets"])
        (link,) = panel["fieldConfig"]["defaults"]["links"]
        assert "${traces}" in link["url"] and "${__data.fields.trace_id}" in link["url"]
