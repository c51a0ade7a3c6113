"""Rendered manifests: valid against the Kubernetes OpenAPI schemas (strict), and right where
it matters: GPU scheduling, GPU requests, probes, drain, volumes, secrets, discovery."""

from __future__ import annotations

import copy
import json
import re
from functools import cache
from typing import Any

import kubernetes_validate
import pytest

from tests.deploy.chart import CHART, MONITORING_APIS, find, helm, render, template_args

K8S_VERSIONS = ("1.25", "1.37")  # the chart's kubeVersion floor and the newest bundled schemas
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
PRESETS = {
    "default": (),
    "b200": ("values-b200.yaml",),
    "b300": ("values-b300.yaml",),
    "embedded": ("values-embedded.yaml",),
}
# Every optional object switched on, so that validation covers them too.
EVERYTHING = ("gateway.autoscaling.enabled=true", "worker.hfToken.value=hf_x")


@cache
def rendered(
    preset: str, sets: tuple[str, ...] = (), monitoring: bool = False
) -> list[dict[str, Any]]:
    return render(PRESETS[preset], sets, MONITORING_APIS if monitoring else ())


def worker_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = find(docs, "StatefulSet")["spec"]["template"]["spec"]
    return spec


def container(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    spec: dict[str, Any] = find(docs, kind)["spec"]["template"]["spec"]["containers"][0]
    return spec


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_manifests_validate_strict(preset: str, version: str) -> None:
    docs = rendered(preset, EVERYTHING, monitoring=True)
    kinds = {d["kind"] for d in docs}
    assert {
        "Deployment",
        "StatefulSet",
        "Service",
        "ConfigMap",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
    } <= kinds
    for doc in docs:
        if doc["kind"] not in CRD_KINDS:  # CRDs: checked by the monitoring tests below
            kubernetes_validate.validate(doc, version, strict=True)


def test_strict_validation_catches_a_misspelled_field() -> None:
    doc = copy.deepcopy(find(rendered("default"), "StatefulSet"))
    doc["spec"]["template"]["spec"]["containers"][0]["startupprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, "1.37", strict=True)


@pytest.mark.parametrize(
    ("preset", "products"),
    [
        ("b200", ["NVIDIA-B200"]),
        ("b300", ["NVIDIA-B300-SXM6-AC", "NVIDIA-B300"]),
        ("default", ["NVIDIA-B200", "NVIDIA-B300-SXM6-AC", "NVIDIA-B300"]),
    ],
)
def test_workers_land_on_the_gpu_pool(preset: str, products: list[str]) -> None:
    pod = worker_pod(rendered(preset))
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [
        {
            "matchExpressions": [
                {"key": "nvidia.com/gpu.product", "operator": "In", "values": products}
            ]
        }
    ]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]


def test_extra_scheduling_is_added_not_replacing() -> None:
    eks = (
        '[{"key":"node.kubernetes.io/instance-type","operator":"In","values":["p6-b200.48xlarge"]}]'
    )
    docs = render(
        ("values-b200.yaml",),
        (
            "worker.nodeSelector.cloud\\.google\\.com/gke-accelerator=nvidia-b200",
            "worker.tolerations[0].key=dedicated",
            "worker.tolerations[0].operator=Equal",
            "worker.tolerations[0].value=llm",
            "worker.tolerations[0].effect=NoSchedule",
            "worker.runtimeClassName=nvidia-cdi",
            "worker.priorityClassName=llm-critical",
        ),
        set_json=(f"worker.extraNodeMatchExpressions={eks}",),
    )
    pod = worker_pod(docs)
    required = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    exprs = required["nodeSelectorTerms"][0]["matchExpressions"]  # one term: ANDed
    assert [e["key"] for e in exprs] == [
        "nvidia.com/gpu.product",
        "node.kubernetes.io/instance-type",
    ]
    assert exprs[1]["values"] == ["p6-b200.48xlarge"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-b200"}
    assert [t["key"] for t in pod["tolerations"]] == ["nvidia.com/gpu", "dedicated"]
    assert pod["runtimeClassName"] == "nvidia-cdi"
    assert pod["priorityClassName"] == "llm-critical"
    assert "podAntiAffinity" in pod["affinity"]


def test_empty_product_list_and_own_node_affinity() -> None:
    pod = worker_pod(render(set_json=("worker.gpu.products=[]", "worker.spreadAcrossNodes=false")))
    assert "affinity" not in pod  # any GPU node; the nvidia.com/gpu request still applies
    term = {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["llm"]}]}
    required = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}
    own = json.dumps({"nodeAffinity": required})
    pod = worker_pod(render(set_json=(f"worker.affinity={own}",)))
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["key"] == "pool"


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_gpu_request_equals_tensor_parallel_size(tp: int) -> None:
    docs = render(("values-b200.yaml",), (f"worker.tensorParallelSize={tp}",))
    res = container(docs, "StatefulSet")["resources"]
    assert res["limits"]["nvidia.com/gpu"] == tp
    assert res["requests"]["nvidia.com/gpu"] == tp
    args = container(docs, "StatefulSet")["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == str(tp)


def test_worker_volumes_shm_and_model_cache() -> None:
    docs = rendered("default")
    sts = find(docs, "StatefulSet")
    volumes = {v["name"]: v for v in worker_pod(docs)["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    mounts = {m["name"]: m["mountPath"] for m in container(docs, "StatefulSet")["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm" and mounts["model-cache"] == "/cache"
    claim = sts["spec"]["volumeClaimTemplates"][0]
    assert claim["metadata"]["name"] == "model-cache"
    assert claim["spec"]["resources"]["requests"]["storage"] == "200Gi"
    env = {e["name"]: e for e in container(docs, "StatefulSet")["env"]}
    assert env["HF_HOME"]["value"] == "/cache/huggingface"


def test_existing_model_claim_and_hf_token_secret() -> None:
    docs = render(
        sets=("worker.modelCache.existingClaim=models-rwx", "worker.hfToken.existingSecret=hf")
    )
    assert "volumeClaimTemplates" not in find(docs, "StatefulSet")["spec"]
    volumes = {v["name"]: v for v in worker_pod(docs)["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] == "models-rwx"
    env = {e["name"]: e for e in container(docs, "StatefulSet")["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    assert not [d for d in docs if d["kind"] == "Secret" and "hf-token" in d["metadata"]["name"]]
    created = render(sets=("worker.hfToken.value=hf_abc",))
    secret = find(created, "Secret", "-worker-hf-token")
    assert secret["data"]["token"] == "aGZfYWJj"  # base64 of hf_abc


def test_worker_probes_allow_a_long_model_load() -> None:
    c = container(rendered("default"), "StatefulSet")
    startup = c["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}


@pytest.mark.parametrize("preset", ["default", "b300", "embedded"])
def test_worker_drain_fits_in_the_grace_period(preset: str) -> None:
    docs = rendered(preset)
    pod, c = worker_pod(docs), container(docs, "StatefulSet")
    sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    drain = int(c["args"][c["args"].index("--drain-timeout") + 1])
    assert sleep > 0 and drain > 0
    assert pod["terminationGracePeriodSeconds"] > sleep + drain


def test_gateway_probes_drain_and_security() -> None:
    docs = rendered("default")
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    env = find(docs, "ConfigMap", "-gateway")["data"]
    assert pod["terminationGracePeriodSeconds"] > sleep + float(
        env["DFLASH_GATEWAY_DRAIN_TIMEOUT_S"]
    )
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert find(docs, "PodDisruptionBudget", "-gateway")["spec"]["minAvailable"] == 1


def test_gateway_discovers_workers_through_the_headless_service() -> None:
    docs = rendered("default")
    svc = find(docs, "Service", "-worker")
    assert svc["spec"]["clusterIP"] == "None"
    assert find(docs, "StatefulSet")["spec"]["serviceName"] == svc["metadata"]["name"]
    pod_labels = find(docs, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    args = container(docs, "Deployment")["args"]
    dns = args[args.index("--worker-dns") + 1]
    assert (
        dns == f"{svc['metadata']['name']}.llm.svc.cluster.local:{svc['spec']['ports'][0]['port']}"
    )
    assert find(docs, "ConfigMap", "-gateway")["data"]["DFLASH_GATEWAY_WORKER_DNS"] == dns


def test_api_keys_created_or_existing() -> None:
    docs = render(set_json=('gateway.apiKeys.keys=["sk-one-1234","sk-two-5678"]',))
    secret = find(docs, "Secret", "-gateway-api-keys")
    assert secret["data"]["api-keys"] == "c2stb25lLTEyMzQKc2stdHdvLTU2NzgK"  # both, one per line
    generated = find(rendered("default"), "Secret", "-gateway-api-keys")
    assert generated["data"]["api-keys"]  # a random key when none is given
    docs = render(sets=("gateway.apiKeys.existingSecret=my-keys",))
    assert not [d for d in docs if d["kind"] == "Secret"]
    vol = {v["name"]: v for v in find(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert vol["api-keys"]["secret"]["secretName"] == "my-keys"
    docs = render(sets=("gateway.apiKeys.enabled=false",))
    assert "DFLASH_GATEWAY_API_KEY_FILE" not in find(docs, "ConfigMap", "-gateway")["data"]


def test_hpa_replaces_fixed_replicas() -> None:
    docs = render(sets=("gateway.autoscaling.enabled=true", "gateway.autoscaling.maxReplicas=7"))
    assert "replicas" not in find(docs, "Deployment")["spec"]
    hpa = find(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["maxReplicas"] == 7
    assert hpa["spec"]["scaleTargetRef"]["name"] == find(docs, "Deployment")["metadata"]["name"]
    assert not [d for d in rendered("default") if d["kind"] == "HorizontalPodAutoscaler"]


def test_embedded_mode_needs_no_gpu() -> None:
    docs = rendered("embedded")
    pod, c = worker_pod(docs), container(docs, "StatefulSet")
    assert c["command"] == ["dflash-worker"] and c["args"][:2] == ["--backend", "embedded"]
    assert "nvidia.com/gpu" not in str(pod)
    assert "volumeClaimTemplates" not in find(docs, "StatefulSet")["spec"]
    assert c["image"].startswith("ghcr.io/dflash-serving/embedded:")
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_every_object_carries_the_release_labels() -> None:
    for doc in rendered("default", EVERYTHING, monitoring=True):
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == "rel"
        assert labels["app.kubernetes.io/component"] in {"gateway", "worker", "monitoring"}
        assert doc["metadata"]["name"].startswith("rel-dflash-serving")


def test_one_object_per_template_file_with_a_component_prefix() -> None:
    proc = helm(*template_args(PRESETS["default"], EVERYTHING, MONITORING_APIS))
    sources = re.findall(r"^# Source: dflash-serving/templates/(\S+)$", proc.stdout, re.M)
    assert len(sources) == len(set(sources)) >= 13
    files = sorted(p.name for p in (CHART / "templates").glob("*.yaml"))
    assert sorted(sources) == files  # everything rendered once, nothing extra
    assert all(f.startswith(("gateway-", "worker-", "monitoring-")) for f in files)


def test_prometheus_gets_a_bare_key_when_metrics_need_auth() -> None:
    docs = render(
        sets=("gateway.metricsRequireAuth=true",),
        set_json=('gateway.apiKeys.keys=["sk-one-1234","sk-two-5678"]',),
        api_versions=MONITORING_APIS,
    )
    secret = find(docs, "Secret", "-gateway-api-keys")
    assert secret["data"]["metrics-token"] == "c2stb25lLTEyMzQ="  # "sk-one-1234", no newline
    auth = find(docs, "ServiceMonitor")["spec"]["endpoints"][0]["authorization"]
    assert auth["credentials"] == {"name": secret["metadata"]["name"], "key": "metrics-token"}
    env = find(docs, "ConfigMap", "-gateway")["data"]
    assert env["DFLASH_GATEWAY_METRICS_AUTH"] == "true"
