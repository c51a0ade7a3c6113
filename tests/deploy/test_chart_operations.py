"""Day-2 behaviour of the chart: worker autoscaling (KEDA, HPA), upgrades that keep serving
(surge, labels stable across chart versions, PDBs, key checksums), multi-node workers, the
Ingress/HTTPRoute, the `helm test` hook, and what NOTES.txt tells about monitoring."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.chart import CHART, MONITORING_APIS, find, helm, render
from tests.deploy.promql import as_rule_file

KEDA = ("ci/autoscaling-keda-values.yaml",)
HPA = ("ci/autoscaling-hpa-values.yaml",)
LWS = ("ci/multinode-lws-values.yaml",)


def promtool_parses(exprs: list[str], tmp_path: Path) -> None:
    path = tmp_path / "queries.yaml"
    path.write_text(as_rule_file(exprs))
    proc = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing: run `make tools`")
def test_keda_scales_workers_on_queue_depth_and_wakes_from_zero(tmp_path: Path) -> None:
    docs = render(KEDA)
    worker = find(docs, "Deployment", "-worker")
    assert "replicas" not in worker["spec"]  # KEDA's HPA owns it
    so = find(docs, "ScaledObject")["spec"]
    assert so["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": worker["metadata"]["name"],
    }
    assert (so["minReplicaCount"], so["maxReplicaCount"]) == (0, 8)  # scale to zero
    triggers = {t["name"]: t for t in so["triggers"]}
    assert set(triggers) == {"waiting-requests", "running-requests", "gateway-requests"}
    waiting = triggers["waiting-requests"]["metadata"]
    assert waiting["query"] == (
        'sum(vllm:num_requests_waiting{namespace="llm",job="llm/rel-dflash-serving-worker"})'
    )
    assert waiting["threshold"] == "4"
    assert triggers["running-requests"]["metadata"]["threshold"] == "51"  # 80 % of 64 seqs
    wake = triggers["gateway-requests"]["metadata"]
    assert (
        'job="rel-dflash-serving-gateway"' in wake["query"] and wake["activationThreshold"] == "0"
    )
    # The gateway counts its own refusals since issue 27: a 401 or 404 must not wake a GPU.
    assert 'status!~"4.."' in wake["query"]
    for t in so["triggers"]:
        assert t["type"] == "prometheus"
        assert t["metadata"]["serverAddress"].startswith("http://kube-prometheus-stack")
    # Slow scale-down: a removed worker costs a model load to bring back.
    behavior = so["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 600
    promtool_parses([t["metadata"]["query"] for t in so["triggers"]], tmp_path)
    # Scaled to zero, "no worker series" is normal: the absent() alert is left out.
    rules = yaml.safe_dump(find(render(KEDA, api_versions=MONITORING_APIS), "PrometheusRule"))
    assert "DFlashWorkerMetricsAbsent" not in rules


def test_hpa_alternative_on_custom_metrics() -> None:
    docs = render(HPA)
    hpa = find(docs, "HorizontalPodAutoscaler", "-worker")
    kubernetes_validate.validate(hpa, "1.37", strict=True)
    assert (
        hpa["spec"]["scaleTargetRef"]["name"]
        == find(docs, "Deployment", "-worker")["metadata"]["name"]
    )
    metrics = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in hpa["spec"]["metrics"]}
    assert metrics == {
        "vllm_num_requests_waiting": {"type": "AverageValue", "averageValue": "4"},
        "vllm_num_requests_running": {"type": "AverageValue", "averageValue": "51"},
    }
    assert hpa["spec"]["minReplicas"] == 2 and hpa["spec"]["maxReplicas"] == 8
    assert not [d for d in docs if d["kind"] == "ScaledObject"]


def chart_copy(tmp_path: Path, version: str) -> Path:
    dest = tmp_path / version / "dflash-serving"
    shutil.copytree(CHART, dest)
    chart = yaml.safe_load((dest / "Chart.yaml").read_text())
    chart["version"] = version
    (dest / "Chart.yaml").write_text(yaml.safe_dump(chart))
    return dest


def pod_templates(chart: Path) -> dict[str, Any]:
    proc = helm(
        "template",
        "rel",
        str(chart),
        "--namespace",
        "llm",
        "--set-json",
        'gateway.apiKeys.keys=["sk-fixed-key-1"]',
        "--set",
        "gateway.apiKeys.workerKey=wk-fixed-key-123456",
    )
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "Deployment"]
    return {d["metadata"]["name"]: d["spec"]["template"] for d in docs}


def test_a_chart_upgrade_alone_restarts_no_pod(tmp_path: Path) -> None:
    # Only the chart version changes (same images, same values): pod templates are identical,
    # so `helm upgrade` rolls nothing (a worker restart is a model load).
    old = pod_templates(chart_copy(tmp_path, "0.1.0"))
    new = pod_templates(chart_copy(tmp_path, "0.2.0"))
    assert old == new and len(old) == 2
    for template in old.values():
        assert "helm.sh/chart" not in template["metadata"]["labels"]
        assert "app.kubernetes.io/version" not in template["metadata"]["labels"]


def test_upgrades_surge_and_keep_serving() -> None:
    worker = find(render(), "Deployment", "-worker")["spec"]
    assert worker["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},  # new pod ready, then old goes
    }
    full_pool = find(
        render(("ci/multi-replica-networkpolicy-values.yaml",)), "Deployment", "-worker"
    )
    assert full_pool["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    gateway = find(render(), "Deployment", "-gateway")["spec"]["strategy"]
    assert gateway["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (("worker.replicas=1",), {"minAvailable": 1}),  # a drain waits, never evicts the only one
        (("worker.replicas=3",), {"maxUnavailable": 1}),
        (("worker.replicas=3", "worker.pdb.minAvailable=2"), {"minAvailable": 2}),
    ],
)
def test_worker_pdb_for_one_and_many_workers(
    sets: tuple[str, ...], expected: dict[str, int]
) -> None:
    spec = find(render(sets=sets), "PodDisruptionBudget", "-worker")["spec"]
    assert {k: v for k, v in spec.items() if k != "selector"} == expected
    hpa = find(render(HPA), "PodDisruptionBudget", "-worker")["spec"]  # autoscaled: min 2
    assert hpa["maxUnavailable"] == 1


def api_key_checksum(*set_json: str, sets: tuple[str, ...] = ()) -> str:
    docs = render(sets=sets, set_json=set_json)
    annotations = find(docs, "Deployment", "-gateway")["spec"]["template"]["metadata"][
        "annotations"
    ]
    checksum: str = annotations["checksum/api-keys"]
    return checksum


def test_new_client_keys_roll_the_gateways_only() -> None:
    one = api_key_checksum('gateway.apiKeys.keys=["sk-one-1234"]')
    assert one == api_key_checksum(
        'gateway.apiKeys.keys=["sk-one-1234"]', sets=("worker.replicas=4",)
    )
    assert one != api_key_checksum('gateway.apiKeys.keys=["sk-one-1234","sk-two-5678"]')
    # Workers never restart for client keys.
    worker = find(
        render(set_json=('gateway.apiKeys.keys=["sk-two-5678"]',)), "Deployment", "-worker"
    )
    assert "annotations" not in worker["spec"]["template"]["metadata"]


def test_multi_node_workers_are_a_leader_worker_set() -> None:
    docs = render(LWS)
    assert not [
        d for d in docs if d["kind"] in {"Deployment"} and "-worker" in d["metadata"]["name"]
    ]
    lws = find(docs, "LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = lws["spec"]
    assert spec["leaderWorkerTemplate"]["size"] == 2
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert spec["rolloutStrategy"]["rollingUpdateConfiguration"] == {
        "maxSurge": 1,
        "maxUnavailable": 0,
    }
    leader = spec["leaderWorkerTemplate"]["leaderTemplate"]
    node = spec["leaderWorkerTemplate"]["workerTemplate"]
    la, na = leader["spec"]["containers"][0]["args"], node["spec"]["containers"][0]["args"]

    def flag(args: list[str], name: str) -> str:
        return args[args.index(name) + 1]

    for args in (la, na):
        assert flag(args, "--tensor-parallel-size") == "8"
        assert flag(args, "--pipeline-parallel-size") == "2"
        assert flag(args, "--nnodes") == "2"
        assert flag(args, "--master-addr") == "$(LWS_LEADER_ADDRESS)"
    assert flag(la, "--node-rank") == "0" and "--headless" not in la
    assert flag(na, "--node-rank") == "$(LWS_WORKER_INDEX)" and "--headless" in na
    # Only the leader serves HTTP: probes, the Service and the PodMonitor select it alone.
    assert "readinessProbe" in leader["spec"]["containers"][0]
    assert "readinessProbe" not in node["spec"]["containers"][0]
    svc = find(docs, "Service", "-worker")["spec"]["selector"]
    assert svc.items() <= leader["metadata"]["labels"].items()
    assert not svc.items() <= node["metadata"]["labels"].items()
    gpus = node["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == 8
    tensor = find(render(LWS, ("worker.multiNode.parallelism=tensor",)), "LeaderWorkerSet")
    targs = tensor["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0][
        "args"
    ]
    assert flag(targs, "--tensor-parallel-size") == "16" and "--pipeline-parallel-size" not in targs


def test_ingress_and_httproute_reach_the_gateway_service() -> None:
    docs = render(("ci/gpu-operator-b300-values.yaml",))
    svc = find(docs, "Service", "-gateway")
    ingress = find(docs, "Ingress")["spec"]
    backend = ingress["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": svc["metadata"]["name"], "port": {"name": "http"}}
    assert ingress["ingressClassName"] == "nginx" and ingress["tls"][0]["hosts"] == [
        "llm.example.com"
    ]
    route = find(render(("ci/gke-b200-values.yaml",)), "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    rule = route["spec"]["rules"][0]
    assert rule["backendRefs"] == [
        {"name": svc["metadata"]["name"], "port": svc["spec"]["ports"][0]["port"]}
    ]
    assert route["spec"]["parentRefs"] == [{"name": "llm-gateway", "namespace": "gateway-infra"}]
    assert rule["timeouts"]["request"] == "930s"  # streams outlive a default 15 s timeout


def test_helm_test_hook_sends_one_chat_completion() -> None:
    proc = helm(
        "template",
        "rel",
        str(CHART),
        "--namespace",
        "llm",
        "--show-only",
        "templates/tests/gateway-test-chat.yaml",
    )
    assert proc.returncode == 0, proc.stderr
    pod = yaml.safe_load(proc.stdout)
    kubernetes_validate.validate(pod, "1.37", strict=True)
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["URL"] == "http://rel-dflash-serving-gateway:80"
    assert env["MODEL"] == "qwen3-8b-dflash"
    assert (
        pod["spec"]["volumes"][0]["secret"]["secretName"] == "rel-dflash-serving-gateway-api-keys"
    )
    script = pod["spec"]["containers"][0]["args"][0]
    compile(script, "helm-test", "exec")  # valid Python; run against a real gateway elsewhere


def notes(tmp_path: Path, *args: str) -> str:
    """NOTES.txt rendered (helm only prints it on install: render it as a template)."""
    chart = tmp_path / "dflash-serving"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "NOTES.txt").rename(chart / "templates" / "notes.txt.yaml")
    proc = helm(
        "template",
        "dflash",
        str(chart),
        "-n",
        "llm",
        "--show-only",
        "templates/notes.txt.yaml",
        *args,
    )
    # Not YAML: helm renders it, then fails to parse it; the text is in --debug's output.
    if proc.returncode != 0:
        proc = helm(
            "template",
            "dflash",
            str(chart),
            "-n",
            "llm",
            "--show-only",
            "templates/notes.txt.yaml",
            "--debug",
            *args,
        )
    return proc.stdout + proc.stderr


def test_notes_say_whether_monitoring_was_rendered(tmp_path: Path) -> None:
    text = notes(tmp_path)
    assert "ServiceMonitor + PodMonitor: NOT rendered" in text
    assert "never\n  under `helm template` without --api-versions" in text
    assert "dflash-gateway" in text and "dflash-dflash" not in text
    assert "WARNING: one worker" in text
    text = notes(tmp_path / "b", "--set", "monitoring.serviceMonitor.enabled=true")
    assert "ServiceMonitor + PodMonitor: rendered" in text
    assert "No `release` label" in text
    text = notes(tmp_path / "c", "-f", str(CHART / "ci/gke-b200-values.yaml"))
    assert "No `release` label" not in text and "WARNING: one worker" not in text


def test_release_label_reaches_every_monitoring_object() -> None:
    docs = render(("ci/gke-b200-values.yaml",))
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        assert find(docs, kind)["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_notes_and_helm_test_name_the_pools(tmp_path: Path) -> None:
    pools = [
        {"name": "chat", "weight": 90},
        {"name": "coder", "model": {"servedModelName": "qwen3-coder"}, "worker": {"replicas": 3}},
    ]
    text = notes(tmp_path, "--set-json", f"pools={json.dumps(pools)}")
    assert 'chat: "qwen3-8b-dflash" at weight 90, 1 × dflash-worker-chat (vllm, 1 GPU(s)' in text
    assert 'coder: "qwen3-coder" at weight 100, 3 × dflash-worker-coder' in text
    assert '"model": "qwen3-8b-dflash"' in text  # the example request names a served model
    docs = render(set_json=(f"pools={json.dumps(list(reversed(pools)))}",))
    pod = find(docs, "Pod", "-test-chat")
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["MODEL"] == "qwen3-coder"
