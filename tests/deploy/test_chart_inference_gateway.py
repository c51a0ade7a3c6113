"""inferenceGateway: every pool an InferencePool with upstream's endpoint picker (EPP), an
HTTPRoute whose weights are the pools', the three modes, the refusals, and every object checked
against upstream's own files at a named release: InferencePool and HTTPRoute against schemas
converted from upstream's CRDs (tests/deploy/crd_schema.py, as kubeconform converts them), the
EPP's flags, config, ports, probes and RBAC against tests/fixtures/inference-extension/
epp-v1.5.0.json (read from the Gateway API Inference Extension's source at v1.5.0)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.deploy.chart import CHART, ROOT, helm, render, template_args
from tests.deploy.promql import exposition_names
from tests.deploy.test_chart_operations import notes  # NOTES.txt rendered
from tests.fixtures import engine_expositions as fx
from tests.fixtures.tiny_models import TinyCheckpoint
from tests.fixtures.worker import WorkerHandle, running_worker

FIXTURES = ROOT / "tests" / "fixtures" / "inference-extension"
EPP = json.loads((FIXTURES / "epp-v1.5.0.json").read_text())
SCHEMAS = {
    "InferencePool": json.loads((FIXTURES / "inferencepool-inference-v1.json").read_text()),
    "HTTPRoute": json.loads((FIXTURES / "httproute-gateway-v1.json").read_text()),
}
GKE = "ci/inference-gateway-values.yaml"
KGATEWAY = "ci/kgateway-inference-values.yaml"
INFERENCE = (
    "inferenceGateway.mode=inference",
    "worker.requireApiKey=false",
    "inferenceGateway.parentRefs[0].name=gw",
)


@cache
def docs_of(values: str = "", sets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    return render((values,) if values else (), sets)


def kind(docs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == name]


def by_name(docs: list[dict[str, Any]], kind_: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind_ and d["metadata"]["name"] == name]
    return doc


def worker_pods(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Worker Deployment name -> its pods' labels."""
    return {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in kind(docs, "Deployment")
        if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
        == "worker"
    }


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def epp_of(docs: list[dict[str, Any]], pool: dict[str, Any]) -> dict[str, Any]:
    return by_name(docs, "Deployment", pool["spec"]["endpointPickerRef"]["name"])


def flags(args: list[str]) -> dict[str, str]:
    """`--name value` and `--name=value` pairs; a bare `--name` is "true"."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        name = args[i].removeprefix("--")
        assert args[i].startswith("--"), args
        if "=" in name:
            key, value = name.split("=", 1)
            out[key] = value
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[name] = args[i + 1]
            i += 1
        else:
            out[name] = "true"
        i += 1
    return out


def epp_config(docs: list[dict[str, Any]], deployment: dict[str, Any]) -> dict[str, Any]:
    pod = deployment["spec"]["template"]["spec"]
    args = flags(pod["containers"][0]["args"])
    mount = pod["containers"][0]["volumeMounts"][0]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    key = args["config-file"].removeprefix(mount["mountPath"] + "/")
    data = by_name(docs, "ConfigMap", volume["configMap"]["name"])["data"]
    config: dict[str, Any] = yaml.safe_load(data[key])
    return config


# ---- one InferencePool per pool -------------------------------------------------------------


@pytest.mark.parametrize("values", [GKE, KGATEWAY])
def test_one_inference_pool_per_pool_selecting_only_its_own_pods(values: str) -> None:
    docs = docs_of(values)
    pools = kind(docs, "InferencePool")
    workers = worker_pods(docs)
    assert len(pools) == len(yaml.safe_load((CHART / values).read_text())["pools"]) == 2
    for pool in pools:
        selector = pool["spec"]["selector"]["matchLabels"]
        chosen = [name for name, labels in workers.items() if selects(selector, labels)]
        assert chosen == [pool["metadata"]["name"]]  # its workers are named as the pool
        worker = by_name(docs, "Deployment", chosen[0])["spec"]["template"]["spec"]
        (port,) = [p for c in worker["containers"] for p in c["ports"] if p["name"] == "http"]
        assert pool["spec"]["targetPorts"] == [{"number": port["containerPort"]}]


def test_the_default_pool_without_a_pools_list() -> None:
    docs = docs_of("", INFERENCE)
    (pool,) = kind(docs, "InferencePool")
    assert pool["metadata"]["name"] == "rel-dflash-serving-worker"
    assert list(worker_pods(docs)) == ["rel-dflash-serving-worker"]
    assert selects(
        pool["spec"]["selector"]["matchLabels"], worker_pods(docs)[pool["metadata"]["name"]]
    )


def test_a_multi_node_pool_picks_its_leaders_only() -> None:
    docs = docs_of("ci/multinode-lws-values.yaml", (*INFERENCE, "networkPolicy.enabled=false"))
    (pool,) = kind(docs, "InferencePool")
    (lws,) = kind(docs, "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selects(selector, template["leaderTemplate"]["metadata"]["labels"])
    assert not selects(selector, template["workerTemplate"]["metadata"]["labels"])


# ---- upstream's endpoint picker ---------------------------------------------------------------


@pytest.mark.parametrize("values", [GKE, KGATEWAY])
def test_the_epp_is_upstreams_as_upstreams_chart_deploys_it(values: str) -> None:
    docs = docs_of(values)
    for pool in kind(docs, "InferencePool"):
        ref = pool["spec"]["endpointPickerRef"]
        deployment = epp_of(docs, pool)
        pod = deployment["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert c["image"] == EPP["image"]
        args = flags(c["args"])
        assert set(args) <= set(EPP["flags"]), set(args) - set(EPP["flags"])
        assert not set(args) & set(EPP["refused_flags"] + EPP["deprecated_flags"])
        assert args["pool-name"] == pool["metadata"]["name"]
        assert args["pool-namespace"] == "llm" and args["pool-group"] == EPP["pool_group"]
        assert args["zap-encoder"] in EPP["zap_encoders"] and int(args["v"]) >= 0
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == EPP["container_ports"]
        for probe in ("livenessProbe", "readinessProbe"):
            assert c[probe]["grpc"] == {
                "port": EPP["defaults"]["grpc-health-port"],
                "service": EPP["probe_services"]["single"],
            }
        assert deployment["spec"]["strategy"] == {"type": "Recreate"}
        service = by_name(docs, "Service", ref["name"])
        assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == EPP["service_ports"]
        assert selects(
            service["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"]
        )
        assert ref["port"]["number"] == EPP["defaults"]["grpc-port"]
        assert ref["failureMode"] in EPP["inference_pool"]["failure_modes"]
        role = by_name(docs, "Role", pod["serviceAccountName"])
        assert role["rules"] == EPP["rbac_rules"]
        binding = by_name(docs, "RoleBinding", pod["serviceAccountName"])
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        assert binding["subjects"][0]["name"] == pod["serviceAccountName"]


def test_several_epp_replicas_elect_a_leader_as_upstream_does() -> None:
    docs = docs_of("", (*INFERENCE, "inferenceGateway.epp.replicas=2"))
    (pool,) = kind(docs, "InferencePool")
    deployment = epp_of(docs, pool)
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    assert flags(c["args"])["ha-enable-leader-election"] == "true"
    services = EPP["probe_services"]["leader_election"]
    assert c["livenessProbe"]["grpc"]["service"] == services["liveness"]
    assert c["readinessProbe"]["grpc"]["service"] == services["readiness"]
    role = by_name(docs, "Role", deployment["spec"]["template"]["spec"]["serviceAccountName"])
    assert role["rules"] == EPP["rbac_rules"] + EPP["leader_election_rules"]


@pytest.mark.parametrize(
    ("engine", "upstream", "path"),
    [
        ("vllm", "vllm", "/metrics"),
        ("sglang", "sglang", "/metrics"),
        ("embedded", "vllm", "/metrics"),  # engine/worker/metrics.py speaks vLLM's names
        ("trtllm", "trtllm-serve", "/prometheus/metrics"),
    ],
)
def test_each_pools_epp_reads_its_engines_metric_names(
    engine: str, upstream: str, path: str
) -> None:
    docs = docs_of("", (*INFERENCE, f"mode={engine}"))
    (pool,) = kind(docs, "InferencePool")
    config = epp_config(docs, epp_of(docs, pool))
    assert config["apiVersion"] == EPP["config"]["apiVersion"]
    assert config["kind"] == EPP["config"]["kind"]
    assert set(config) <= set(EPP["config"]["keys"])
    plugins = {p["type"]: p for p in config["plugins"]}
    assert set(plugins) <= set(EPP["plugin_types"])
    assert sorted(plugins) == sorted(EPP["default_plugins"]["plugins"])
    for p in config["plugins"]:
        assert set(p) <= set(EPP["config"]["plugin_keys"])
        assert set(p.get("parameters", {})) <= set(EPP["plugin_parameters"].get(p["type"], []))
    assert plugins["core-metrics-extractor"]["parameters"]["defaultEngine"] == upstream
    assert upstream in EPP["engines"]
    assert plugins["metrics-data-source"]["parameters"]["path"] == path
    assert EPP["engines"][upstream].get("metrics_path", "/metrics") == path
    (profile,) = config["schedulingProfiles"]
    weights = {p["pluginRef"]: p["weight"] for p in profile["plugins"]}
    assert weights == EPP["default_plugins"]["weights"]


def test_mixed_engine_pools_each_get_their_own_names() -> None:
    docs = docs_of(KGATEWAY)
    engines = {}
    for pool in kind(docs, "InferencePool"):
        plugins = epp_config(docs, epp_of(docs, pool))["plugins"]
        (extractor,) = [p for p in plugins if p["type"] == "core-metrics-extractor"]
        engines[pool["metadata"]["name"]] = extractor["parameters"]
    assert engines == {
        "rel-dflash-serving-worker-chat": {"defaultEngine": "vllm"},
        "rel-dflash-serving-worker-coder": {"defaultEngine": "sglang"},
    }


# ---- the route --------------------------------------------------------------------------------


def backends(rule: dict[str, Any]) -> dict[str, int]:
    return {b["name"]: b["weight"] for b in rule["backendRefs"]}


def test_httproute_splits_a_model_by_the_pools_weights() -> None:
    docs = docs_of(GKE)
    values = yaml.safe_load((CHART / GKE).read_text())
    (route,) = kind(docs, "HTTPRoute")
    assert route["spec"]["parentRefs"] == values["inferenceGateway"]["parentRefs"]
    (rule,) = route["spec"]["rules"]  # one model: no header to match
    assert "headers" not in rule["matches"][0]
    weights = {f"rel-dflash-serving-worker-{p['name']}": p["weight"] for p in values["pools"]}
    assert (
        backends(rule)
        == weights
        == {
            "rel-dflash-serving-worker-baseline": 90,
            "rel-dflash-serving-worker-canary": 10,
        }
    )
    assert all(b["kind"] == "InferencePool" for b in rule["backendRefs"])
    # GKE reads no route timeout: a GCPBackendPolicy per InferencePool keeps streams open.
    assert "timeouts" not in rule
    for pool in kind(docs, "InferencePool"):
        name = pool["metadata"]["name"]
        policy = by_name(docs, "GCPBackendPolicy", name)
        assert policy["spec"]["targetRef"]["kind"] == "InferencePool"
        assert policy["spec"]["default"]["timeoutSec"] == 930
        health = by_name(docs, "HealthCheckPolicy", name)["spec"]["default"]["config"]
        assert health["httpHealthCheck"] == {"requestPath": "/health", "port": 8000}


def test_httproute_tells_several_models_apart_by_the_body_based_routing_header() -> None:
    docs = docs_of(KGATEWAY)
    (route,) = kind(docs, "HTTPRoute")
    rules = {r["matches"][0]["headers"][0]["value"]: r for r in route["spec"]["rules"]}
    assert set(rules) == {"qwen3-8b", "qwen3-coder-30b"}
    for rule in rules.values():
        (header,) = rule["matches"][0]["headers"]
        assert header["name"] == EPP["body_based_routing"]["model_header"]
        assert header["type"] == "Exact"
        assert rule["timeouts"] == {"request": "930s"}  # gateway.requestTimeoutSeconds + 30
    assert backends(rules["qwen3-8b"]) == {"rel-dflash-serving-worker-chat": 100}
    assert backends(rules["qwen3-coder-30b"]) == {"rel-dflash-serving-worker-coder": 100}


@pytest.mark.parametrize("values", [GKE, KGATEWAY])
def test_objects_validate_against_upstreams_crd_schemas(values: str) -> None:
    docs = docs_of(values)
    checked = [d for d in docs if d["kind"] in SCHEMAS]
    assert {d["kind"] for d in checked} == set(SCHEMAS)
    for doc in checked:
        jsonschema.validate(doc, SCHEMAS[doc["kind"]])


def test_the_converted_schemas_catch_a_misspelled_field() -> None:
    docs = docs_of(GKE)
    pool = copy.deepcopy(kind(docs, "InferencePool")[0])
    pool["spec"]["targetPort"] = pool["spec"].pop("targetPorts")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, SCHEMAS["InferencePool"])
    route = copy.deepcopy(kind(docs, "HTTPRoute")[0])
    route["spec"]["rules"][0]["backendRefs"][0]["weight"] = -1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(route, SCHEMAS["HTTPRoute"])


# ---- three modes ------------------------------------------------------------------------------


def gateway_objects(docs: list[dict[str, Any]]) -> list[str]:
    return [
        f"{d['kind']}/{d['metadata']['name']}"
        for d in docs
        if d["metadata"]["name"].startswith("rel-dflash-serving-gateway")
    ]


def test_three_modes() -> None:
    ours = docs_of("", ("worker.requireApiKey=false",))
    assert not kind(ours, "InferencePool") and gateway_objects(ours)
    only = docs_of("", INFERENCE)
    assert gateway_objects(only) == []
    assert {d["kind"] for d in only} >= {"InferencePool", "HTTPRoute", "Deployment"}
    both = docs_of("", (*INFERENCE[1:], "inferenceGateway.mode=both"))
    assert kind(
        both, "InferencePool"
    ) and "Deployment/rel-dflash-serving-gateway" in gateway_objects(both)
    # Mode both with no Gateway named: the pools without a route (the user attaches one).
    unrouted = docs_of("", ("worker.requireApiKey=false", "inferenceGateway.mode=both"))
    assert kind(unrouted, "InferencePool") and not kind(unrouted, "HTTPRoute")


def test_inference_only_drops_the_alerts_on_gateway_series() -> None:
    sets = (*INFERENCE, "monitoring.prometheusRule.enabled=true")
    groups = {g["name"]: g for g in kind(docs_of("", sets), "PrometheusRule")[0]["spec"]["groups"]}
    assert "dflash-serving.recording" not in groups  # gateway series only
    alerts = {r["alert"] for g in groups.values() for r in g["rules"] if "alert" in r}
    assert "DFlashGatewayDown" not in alerts  # it would fire for ever on absent()
    assert {"DFlashDrafterMismatch", "DFlashQueueBacklog", "DFlashKVCachePressure"} <= alerts
    assert len(groups["dflash-serving.engines"]["rules"]) >= 8


REFUSALS = [
    (
        ("inferenceGateway.mode=inference", "worker.requireApiKey=false"),
        "inferenceGateway.parentRefs:",
    ),
    (("inferenceGateway.parentRefs[0].name=gw",), "need inferenceGateway.mode inference or both"),
    (("inferenceGateway.mode=both",), "worker.requireApiKey:"),
    ((*INFERENCE, "gateway.ingress.enabled=true"), "gateway.ingress.enabled:"),
    ((*INFERENCE, "gateway.httpRoute.enabled=true"), "gateway.httpRoute.enabled:"),
    ((*INFERENCE, "gateway.autoscaling.enabled=true"), "gateway.autoscaling.enabled:"),
    ((*INFERENCE, "gateway.rateLimits.redis.deploy=true"), "gateway.rateLimits.redis.deploy:"),
    ((*INFERENCE, "networkPolicy.enabled=true"), "inferenceGateway.networkPolicyPeers:"),
    (
        (*INFERENCE, "inferenceGateway.provider=gke", "inferenceGateway.requestTimeout=60s"),
        "inferenceGateway.requestTimeout:",
    ),
    ((*INFERENCE, "inferenceGateway.mode=gateway"), "inferenceGateway.mode"),
]


@pytest.mark.parametrize(("sets", "message"), REFUSALS, ids=[m for _, m in REFUSALS])
def test_combinations_that_cannot_work_are_refused_naming_the_value(
    sets: tuple[str, ...], message: str
) -> None:
    proc = helm(*template_args((), sets))
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_a_pool_asking_for_the_worker_key_and_a_fractional_weight_are_refused() -> None:
    keyed = [{"name": "a"}, {"name": "b", "worker": {"requireApiKey": True}}]
    proc = helm(*template_args((), INFERENCE, set_json=(f"pools={json.dumps(keyed)}",)))
    assert proc.returncode != 0 and "pools[b].worker.requireApiKey:" in proc.stderr
    half = [{"name": "a", "weight": 99.5}, {"name": "b", "weight": 0.5}]
    proc = helm(*template_args((), INFERENCE, set_json=(f"pools={json.dumps(half)}",)))
    assert proc.returncode != 0 and "pools[0].weight: 99.5 is not a whole number" in proc.stderr


def test_network_policy_admits_the_gateways_proxies_and_the_pools_epp() -> None:
    docs = docs_of(KGATEWAY)
    peers = yaml.safe_load((CHART / KGATEWAY).read_text())["inferenceGateway"]["networkPolicyPeers"]
    for pool in kind(docs, "InferencePool"):
        policy = by_name(docs, "NetworkPolicy", pool["metadata"]["name"])
        epp_labels = epp_of(docs, pool)["spec"]["template"]["metadata"]["labels"]
        (rule,) = [r for r in policy["spec"]["ingress"] if r["from"][: len(peers)] == peers]
        (epp,) = rule["from"][len(peers) :]
        assert selects(epp["podSelector"]["matchLabels"], epp_labels)
        assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]


# ---- helm test through the user's Gateway --------------------------------------------------


def inference_test_pod(values: str) -> dict[str, Any]:
    (pod,) = [d for d in docs_of(values) if d["metadata"]["name"].endswith("-test-inference")]
    return pod


def test_helm_test_goes_through_the_gateway_only_when_its_address_is_given() -> None:
    pod = inference_test_pod(KGATEWAY)
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["URL"] == "http://inference-gateway.kgateway-system.svc.cluster.local"
    assert json.loads(env["MODELS"]) == ["qwen3-8b", "qwen3-coder-30b"]
    assert env["HOST"] == "llm.example.com"
    assert not [d for d in docs_of("", INFERENCE) if d["kind"] == "Pod"]  # no address, no test


@pytest.fixture(scope="module")
def upstream(tiny_checkpoint: TinyCheckpoint) -> Iterator[WorkerHandle]:
    """A real embedded worker, standing in for what the Gateway routes to."""
    args = (str(tiny_checkpoint.target_dir), "--served-model-name", "qwen3-8b")
    with running_worker(*args) as worker:
        yield worker


def test_the_helm_test_script_passes_against_a_real_worker(upstream: WorkerHandle) -> None:
    pod = inference_test_pod(GKE)
    script = pod["spec"]["containers"][0]["args"][0]
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    env = {**env, "URL": upstream.base_url, "HOST": "", "PATH": "/usr/bin:/bin"}
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "through the Gateway ok: qwen3-8b" in run.stdout
    wrong = {**env, "MODELS": json.dumps(["qwen3-8b", "no-such-model"])}
    run = subprocess.run(
        [sys.executable, "-c", script], env=wrong, capture_output=True, text=True, timeout=120
    )
    assert run.returncode != 0  # a model the route does not serve fails the test


def test_lint_strict_passes_with_the_examples() -> None:
    for values in (GKE, KGATEWAY):
        proc = helm("lint", "--strict", str(CHART), "-f", str(CHART / values))
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_notes_tell_the_inference_door_and_no_gateway_of_ours(tmp_path: Path) -> None:
    only = notes(tmp_path / "a", "-f", str(CHART / GKE))
    assert "Inference gateway (inferenceGateway.mode=inference)" in only
    assert "Clients call the Gateway inference-gateway" in only
    assert "port-forward svc/dflash-gateway" not in only
    both = notes(tmp_path / "b", "-f", str(CHART / KGATEWAY))
    assert "Inference gateway (inferenceGateway.mode=both)" in both
    assert "port-forward svc/dflash-gateway" in both


@pytest.mark.parametrize(("engine", "upstream"), [("sglang", "sglang"), ("trtllm", "trtllm-serve")])
def test_each_engines_workers_export_the_load_series_its_epp_scrapes(
    engine: str, upstream: str
) -> None:
    """SGLang's and TensorRT-LLM's expositions as their source writes them (the fixture that
    test_monitoring_engines.py checks against SGLang 0.5.23's source) carry the queue, running
    and KV-cache names of the EPP's engine config. vLLM and the embedded worker:
    tests/e2e/test_real_vllm.py and tests/engine/worker/test_metrics.py."""
    exported = exposition_names(fx.EXPOSITIONS[engine](1))
    for key in ("queued", "running", "kv_usage"):
        assert EPP["engines"][upstream][key] in exported, key


def test_istio_gets_a_destination_rule_per_epp_as_upstream_renders_it() -> None:
    docs = docs_of("", (*INFERENCE, "inferenceGateway.provider=istio"))
    (pool,) = kind(docs, "InferencePool")
    (rule,) = kind(docs, "DestinationRule")
    service = pool["spec"]["endpointPickerRef"]["name"]
    assert rule["spec"]["host"] == f"{service}.llm.svc.cluster.local"
    assert rule["spec"]["trafficPolicy"]["tls"] == {"mode": "SIMPLE", "insecureSkipVerify": True}
    assert not kind(docs_of("", INFERENCE), "DestinationRule")  # other providers: none
