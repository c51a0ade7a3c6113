"""Rendered manifests: valid against the Kubernetes OpenAPI schemas (strict) for every preset
and every ci/ example, CRD objects checked for structure, and right where it matters: GPU
scheduling per platform, GPU-proportional resources, probes, drain, volumes, discovery."""

from __future__ import annotations

import copy
import json
import re
from functools import cache
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.chart import (
    CHART,
    CI_VALUES,
    MONITORING_APIS,
    find,
    helm,
    render,
    template_args,
)

K8S_VERSIONS = ("1.25", "1.37")  # the chart's kubeVersion floor and the newest bundled schemas
# CRDs kubernetes-validate has no schema for: checked by structure in the tests below (and, for
# the LeaderWorkerSet, its pod templates are validated strictly as core PodTemplates).
CRD_KINDS = {
    "ServiceMonitor",
    "PodMonitor",
    "PrometheusRule",
    "ScaledObject",
    "LeaderWorkerSet",
    "HTTPRoute",
    "GCPBackendPolicy",  # GKE's networking.gke.io/v1, checked field by field below
    # Upstream's CRD schemas: test_chart_inference_gateway.py; GKE's policy by field there.
    "InferencePool",
    "HealthCheckPolicy",
}
PRESETS: dict[str, tuple[str, ...]] = {
    "default": (),
    "b200": ("values-b200.yaml",),
    "b300": ("values-b300.yaml",),
    "embedded": ("values-embedded.yaml",),
    **{name: (name,) for name in CI_VALUES},
}
# Every optional object switched on, so that validation covers them too.
EVERYTHING = (
    "gateway.autoscaling.enabled=true",
    "worker.hfToken.value=hf_x",
    "gateway.ingress.enabled=true",
    "networkPolicy.enabled=true",
    "gateway.rateLimits.redis.deploy=true",
)


# What inferenceGateway.mode=inference refuses: objects of the dflash gateway it does not run.
GATEWAY_ONLY = {s for s in EVERYTHING if s.startswith("gateway.")}


@cache
def rendered(
    preset: str, sets: tuple[str, ...] = (), monitoring: bool = False
) -> list[dict[str, Any]]:
    files = PRESETS[preset]
    modes = {
        (yaml.safe_load((CHART / f).read_text()).get("inferenceGateway") or {}).get("mode")
        for f in files
    }
    if "inference" in modes:
        sets = tuple(s for s in sets if s not in GATEWAY_ONLY)
    return render(files, sets, MONITORING_APIS if monitoring else ())


def workload(docs: list[dict[str, Any]]) -> dict[str, Any]:
    hits = [d for d in docs if d["kind"] in {"Deployment", "LeaderWorkerSet"}]
    return next(d for d in hits if d["metadata"]["name"].endswith("-worker"))


def worker_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = find(docs, "Deployment", "-worker")["spec"]["template"]["spec"]
    return spec


def container(docs: list[dict[str, Any]], suffix: str) -> dict[str, Any]:
    spec = find(docs, "Deployment", suffix)["spec"]["template"]["spec"]
    c: dict[str, Any] = spec["containers"][0]
    return c


def validate(doc: dict[str, Any], version: str) -> None:
    if doc["kind"] == "LeaderWorkerSet":
        lwt = doc["spec"]["leaderWorkerTemplate"]
        for key in ("leaderTemplate", "workerTemplate"):
            template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": key}}
            kubernetes_validate.validate({**template, "template": lwt[key]}, version, strict=True)
    elif doc["kind"] not in CRD_KINDS:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_manifests_validate_strict(preset: str, version: str) -> None:
    docs = rendered(preset, EVERYTHING, monitoring=True)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    for doc in docs:
        validate(doc, version)


def test_strict_validation_catches_a_misspelled_field() -> None:
    doc = copy.deepcopy(find(rendered("default"), "Deployment", "-worker"))
    doc["spec"]["template"]["spec"]["containers"][0]["startupprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, "1.37", strict=True)
    lws = copy.deepcopy(find(rendered("ci/multinode-lws-values.yaml"), "LeaderWorkerSet"))
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["argz"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(lws, "1.37")


# (preset, node label key, values, runtimeClassName)
PLATFORMS = [
    ("ci/gke-b200-values.yaml", "cloud.google.com/gke-accelerator", ["nvidia-b200"], None),
    ("ci/eks-b200-values.yaml", "node.kubernetes.io/instance-type", ["p6-b200.48xlarge"], None),
    (
        "ci/gpu-operator-b300-values.yaml",
        "nvidia.com/gpu.product",
        ["NVIDIA-B300-SXM6-AC", "NVIDIA-B300"],
        "nvidia",
    ),
]


@pytest.mark.parametrize(("preset", "key", "values", "runtime"), PLATFORMS)
def test_workers_land_on_the_platforms_gpu_nodes(
    preset: str, key: str, values: list[str], runtime: str | None
) -> None:
    pod = worker_pod(rendered(preset))
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    exprs = terms["nodeSelectorTerms"][0]["matchExpressions"]
    assert exprs == [{"key": key, "operator": "In", "values": values}]
    assert pod.get("runtimeClassName") == runtime  # only where the RuntimeClass exists
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]


@pytest.mark.parametrize("preset", ["default", "b200", "b300"])
def test_generic_presets_need_no_gpu_operator(preset: str) -> None:
    # Any node with the nvidia.com/gpu resource: no product label, no RuntimeClass required.
    pod = worker_pod(rendered(preset))
    assert "nodeAffinity" not in pod.get("affinity", {})
    assert "runtimeClassName" not in pod
    assert container(rendered(preset), "-worker")["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_extra_scheduling_is_added_not_replacing() -> None:
    karpenter = '[{"key":"karpenter.sh/capacity-type","operator":"In","values":["on-demand"]}]'
    docs = render(
        ("ci/eks-b200-values.yaml",),
        (
            "worker.nodeSelector.topology\\.kubernetes\\.io/zone=us-east-1a",
            "worker.tolerations[0].key=dedicated",
            "worker.tolerations[0].operator=Equal",
            "worker.tolerations[0].value=llm",
            "worker.tolerations[0].effect=NoSchedule",
            "worker.gpu.tolerateGpuTaint=true",
            "worker.runtimeClassName=nvidia-cdi",
            "worker.priorityClassName=llm-critical",
        ),
        set_json=(f"worker.extraNodeMatchExpressions={karpenter}",),
    )
    pod = worker_pod(docs)
    required = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    exprs = required["nodeSelectorTerms"][0]["matchExpressions"]  # one term: ANDed
    assert [e["key"] for e in exprs] == [
        "node.kubernetes.io/instance-type",
        "karpenter.sh/capacity-type",
    ]
    assert pod["nodeSelector"] == {"topology.kubernetes.io/zone": "us-east-1a"}
    assert [t["key"] for t in pod["tolerations"]] == ["nvidia.com/gpu", "dedicated"]
    assert pod["runtimeClassName"] == "nvidia-cdi"
    assert pod["priorityClassName"] == "llm-critical"
    assert "podAntiAffinity" in pod["affinity"]


def test_label_key_override_and_own_node_affinity() -> None:
    aks = render(
        sets=("worker.gpu.nodeLabelKey=kubernetes.azure.com/accelerator",),
        set_json=('worker.gpu.nodeLabelValues=["nvidia"]', "worker.spreadAcrossNodes=false"),
    )
    exprs = worker_pod(aks)["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert exprs["nodeSelectorTerms"][0]["matchExpressions"][0]["key"] == (
        "kubernetes.azure.com/accelerator"
    )
    term = {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["llm"]}]}
    required = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}
    own = json.dumps({"nodeAffinity": required})
    pod = worker_pod(render(("ci/gke-b200-values.yaml",), set_json=(f"worker.affinity={own}",)))
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["key"] == "pool"


@pytest.mark.parametrize("tp", [1, 4, 8])
def test_gpus_cpu_memory_and_shm_scale_with_tensor_parallelism(tp: int) -> None:
    docs = render(sets=(f"worker.tensorParallelSize={tp}", "worker.resources.limits.cpu=99"))
    c = container(docs, "-worker")
    res = c["resources"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == tp
    assert res["requests"]["cpu"] == str(8 * tp)
    assert res["requests"]["memory"] == f"{64 * tp}Gi"
    assert res["limits"]["memory"] == f"{128 * tp}Gi"
    assert res["limits"]["cpu"] == 99  # worker.resources merged over the per-GPU sizing
    volumes = {v["name"]: v for v in worker_pod(docs)["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{8 * tp}Gi"}
    assert c["args"][c["args"].index("--tensor-parallel-size") + 1] == str(tp)


def volume_and_env(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    volumes = {v["name"]: v for v in worker_pod(docs)["volumes"]}
    env = {e["name"]: e.get("value") for e in container(docs, "-worker")["env"]}
    return volumes, env


def test_model_cache_per_pod_options() -> None:
    volumes, env = volume_and_env(rendered("default"))
    assert volumes["model-cache"] == {"name": "model-cache", "emptyDir": {"sizeLimit": "200Gi"}}
    assert env["HF_HOME"] == "/cache/huggingface" and "HF_HUB_OFFLINE" not in env
    docs = render(
        sets=("worker.modelCache.type=ephemeral", "worker.modelCache.storageClassName=ssd")
    )
    claim = volume_and_env(docs)[0]["model-cache"]["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert (
        claim["storageClassName"] == "ssd" and claim["resources"]["requests"]["storage"] == "200Gi"
    )
    # No volumeClaimTemplates: size and class changes are pod-template changes, never a
    # rejected `helm upgrade`.
    assert not [d for d in docs if d["kind"] in {"StatefulSet", "PersistentVolumeClaim"}]


def test_model_cache_shared_and_pre_pulled() -> None:
    docs = rendered("ci/gke-b200-values.yaml")
    pvc = find(docs, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["storageClassName"] == "standard-rwx"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    volumes, _ = volume_and_env(docs)
    assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    docs = rendered("ci/eks-b200-values.yaml")
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert volume_and_env(docs)[0]["model-cache"]["persistentVolumeClaim"] == {
        "claimName": "models-efs"
    }
    docs = rendered("ci/gpu-operator-b300-values.yaml")
    volumes, env = volume_and_env(docs)
    assert volumes["model-cache"]["hostPath"] == {"path": "/mnt/models", "type": "Directory"}
    mounts = {m["name"]: m for m in container(docs, "-worker")["volumeMounts"]}
    assert mounts["model-cache"]["readOnly"] is True
    assert env["HF_HUB_OFFLINE"] == "1"  # never reaches for the hub


def test_extra_volumes_and_hf_token() -> None:
    docs = render(
        sets=("worker.hfToken.existingSecret=hf", "worker.modelCache.offline=true"),
        set_json=(
            'worker.extraVolumes=[{"name":"drafters","configMap":{"name":"d"}}]',
            'worker.extraVolumeMounts=[{"name":"drafters","mountPath":"/drafters"}]',
        ),
    )
    volumes, env = volume_and_env(docs)
    assert volumes["drafters"]["configMap"] == {"name": "d"}
    mounts = {m["name"]: m["mountPath"] for m in container(docs, "-worker")["volumeMounts"]}
    assert mounts["drafters"] == "/drafters" and env["HF_HUB_OFFLINE"] == "1"
    full = {e["name"]: e for e in container(docs, "-worker")["env"]}
    # A Secret made outside the chart may be missing (ungated models): the pod still starts.
    assert full["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "hf",
        "key": "token",
        "optional": True,
    }
    made = render(sets=("worker.hfToken.value=hf_abc",))
    secret = find(made, "Secret", "-worker-hf-token")
    assert secret["data"]["token"] == "aGZfYWJj"  # base64 of hf_abc
    # The chart's own Secret always exists: no optional reference.
    ref = {e["name"]: e for e in container(made, "-worker")["env"]}["HF_TOKEN"]
    assert "optional" not in ref["valueFrom"]["secretKeyRef"]


def test_worker_probes_allow_a_long_model_load() -> None:
    docs = rendered("default")
    c = container(docs, "-worker")
    startup = c["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= 20 * 60
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # The Deployment only reports a stuck rollout after a whole model load.
    assert find(docs, "Deployment", "-worker")["spec"]["progressDeadlineSeconds"] > budget


@pytest.mark.parametrize("preset", ["default", "b300", "embedded"])
def test_worker_drain_fits_in_the_grace_period(preset: str) -> None:
    docs = rendered(preset)
    pod, c = worker_pod(docs), container(docs, "-worker")
    sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    drain = int(c["args"][c["args"].index("--drain-timeout") + 1])
    assert sleep > 0 and drain > 0
    assert pod["terminationGracePeriodSeconds"] > sleep + drain


def test_gateway_probes_drain_and_pdb() -> None:
    docs = rendered("default")
    pod = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    env = find(docs, "ConfigMap", "-gateway")["data"]
    assert pod["terminationGracePeriodSeconds"] > sleep + float(
        env["DFLASH_GATEWAY_DRAIN_TIMEOUT_S"]
    )
    assert find(docs, "PodDisruptionBudget", "-gateway")["spec"]["minAvailable"] == 1


def test_gateway_discovers_workers_through_the_headless_service() -> None:
    docs = rendered("default")
    svc = find(docs, "Service", "-worker")
    assert svc["spec"]["clusterIP"] == "None"
    pod_labels = find(docs, "Deployment", "-worker")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    args = container(docs, "-gateway")["args"]
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
    assert generated["data"]["api-keys"] and generated["data"]["worker-api-key"]
    docs = rendered("ci/multi-replica-networkpolicy-values.yaml")
    assert not [d for d in docs if d["kind"] == "Secret"]
    pod = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["api-keys"]["secret"]["secretName"] == (
        "dflash-api-keys"
    )
    docs = render(sets=("gateway.apiKeys.enabled=false", "worker.requireApiKey=false"))
    assert "DFLASH_GATEWAY_API_KEY_FILE" not in find(docs, "ConfigMap", "-gateway")["data"]
    assert "--api-key" not in container(docs, "-worker")["args"]


def secret_ref(env: list[dict[str, Any]], name: str) -> dict[str, str]:
    ref: dict[str, str] = next(e for e in env if e["name"] == name)["valueFrom"]["secretKeyRef"]
    return ref


@pytest.mark.parametrize("preset", ["default", "embedded", "ci/multinode-lws-values.yaml"])
def test_workers_require_the_key_the_gateway_sends(preset: str) -> None:
    docs = rendered(preset)
    gw = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    sent = secret_ref(gw["env"], "DFLASH_GATEWAY_WORKER_API_KEY")
    lws = [d for d in docs if d["kind"] == "LeaderWorkerSet"]
    if lws:
        lwt = lws[0]["spec"]["leaderWorkerTemplate"]
        pods = [lwt["leaderTemplate"]["spec"], lwt["workerTemplate"]["spec"]]
    else:
        pods = [worker_pod(docs)]
    for pod in pods:
        c = pod["containers"][0]
        assert secret_ref(c["env"], "DFLASH_WORKER_API_KEY") == sent  # one Secret, both sides
        # Expanded by the kubelet from the env: the key itself is not in the pod spec.
        assert c["args"][c["args"].index("--api-key") + 1] == "$(DFLASH_WORKER_API_KEY)"
    secret = find(docs, "Secret", "-gateway-api-keys")
    assert sent == {"name": secret["metadata"]["name"], "key": "worker-api-key"}
    assert secret["data"]["worker-api-key"] != secret["data"]["metrics-token"]


def test_network_policy_admits_only_the_gateway_and_monitoring() -> None:
    docs = rendered("ci/multi-replica-networkpolicy-values.yaml")
    policy = find(docs, "NetworkPolicy")["spec"]
    worker_labels = find(docs, "Deployment", "-worker")["spec"]["template"]["metadata"]["labels"]
    gateway_labels = find(docs, "Deployment", "-gateway")["spec"]["template"]["metadata"]["labels"]
    selects = {e["key"]: e["values"] for e in policy["podSelector"]["matchExpressions"]}
    assert all(worker_labels[k] in v for k, v in selects.items())
    assert policy["policyTypes"] == ["Ingress"]
    gateway_rule, monitoring_rule = policy["ingress"]
    peers = gateway_rule["from"]
    assert len(peers) == 1 and peers[0]["podSelector"]["matchLabels"].items() <= (
        gateway_labels.items()
    )
    assert "namespaceSelector" not in peers[0]  # this namespace only
    assert monitoring_rule["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        }
    ]
    assert monitoring_rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    # Multi-node: the pods of a group also reach each other (vLLM's rendezvous and NCCL).
    lws_policy = find(rendered("ci/multinode-lws-values.yaml"), "NetworkPolicy")["spec"]
    own = lws_policy["ingress"][0]["from"][1]["podSelector"]["matchExpressions"]
    assert {
        "key": "app.kubernetes.io/component",
        "operator": "In",
        "values": ["worker", "worker-node"],
    } in own


RESTRICTED_EXEMPT = {"ci/gpu-operator-b300-values.yaml"}  # hostPath cache: Pod Security baseline


def pod_security_violations(pod: dict[str, Any]) -> list[str]:
    """The Pod Security "restricted" rules a pod spec breaks (the ones a chart controls)."""
    bad = []
    ctx = pod.get("securityContext", {})
    if pod.get("automountServiceAccountToken") is not False:
        bad.append("service-account token mounted")
    if any("hostPath" in v for v in pod.get("volumes", [])):
        bad.append("hostPath volume")
    if ctx.get("seccompProfile", {}).get("type") not in {"RuntimeDefault", "Localhost"}:
        bad.append("seccomp")
    for c in pod["containers"]:
        sc = c.get("securityContext", {})
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{c['name']}: privilege escalation")
        if sc.get("capabilities", {}).get("drop") != ["ALL"]:
            bad.append(f"{c['name']}: capabilities")
        if not (sc.get("runAsNonRoot") or ctx.get("runAsNonRoot")):
            bad.append(f"{c['name']}: may run as root")
        if sc.get("privileged") or (sc.get("runAsUser", ctx.get("runAsUser")) == 0):
            bad.append(f"{c['name']}: root")
    return bad


@pytest.mark.parametrize("preset", list(PRESETS))
def test_pods_pass_pod_security_restricted(preset: str) -> None:
    docs = rendered(preset)
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Deployment"]
    for lws in (d for d in docs if d["kind"] == "LeaderWorkerSet"):
        lwt = lws["spec"]["leaderWorkerTemplate"]
        pods += [lwt["leaderTemplate"]["spec"], lwt["workerTemplate"]["spec"]]
    problems = []
    for pod in pods:
        found = pod_security_violations(pod)
        # The endpoint picker watches its InferencePool and the pool's pods: it mounts its
        # token explicitly, the one exception to the chart's own no-token rule.
        if pod.get("serviceAccountName", "").endswith("-epp"):
            assert pod["automountServiceAccountToken"] is True
            found.remove("service-account token mounted")
        problems += found
    if preset in RESTRICTED_EXEMPT:
        assert problems == ["hostPath volume"]  # documented: needs a baseline-exempt namespace
    else:
        assert problems == []


def test_hpa_replaces_fixed_replicas() -> None:
    docs = render(sets=("gateway.autoscaling.enabled=true", "gateway.autoscaling.maxReplicas=7"))
    assert "replicas" not in find(docs, "Deployment", "-gateway")["spec"]
    hpa = find(docs, "HorizontalPodAutoscaler", "-gateway")
    assert hpa["spec"]["maxReplicas"] == 7
    assert not [d for d in rendered("default") if d["kind"] == "HorizontalPodAutoscaler"]


def test_embedded_mode_needs_no_gpu() -> None:
    docs = rendered("embedded")
    pod, c = worker_pod(docs), container(docs, "-worker")
    assert c["command"] == ["dflash-worker"] and c["args"][:2] == ["--backend", "embedded"]
    assert "nvidia.com/gpu" not in str(pod)
    assert "model-cache" not in str(pod)
    assert c["image"].startswith("ghcr.io/dflash-serving/embedded:")
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_every_object_carries_the_release_labels() -> None:
    for doc in rendered("default", EVERYTHING, monitoring=True):
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == "rel"
        assert labels["app.kubernetes.io/component"] in {"gateway", "worker", "monitoring", "redis"}
        assert doc["metadata"]["name"].startswith("rel-dflash-serving")


@pytest.mark.parametrize(
    ("release", "override", "prefix"),
    [
        ("dflash", "", "dflash"),  # not dflash-dflash-serving
        ("dflash-serving-prod", "", "dflash-serving-prod"),
        ("chat", "", "chat-dflash-serving"),
        ("chat", "llm", "llm"),
        ("x", "a" * 80, "a" * 54),
    ],
)
def test_object_names(release: str, override: str, prefix: str) -> None:
    args = ["template", release, str(CHART), "--set", f"fullnameOverride={override}"]
    proc = helm(*args)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    names = {d["metadata"]["name"] for d in docs}
    assert {f"{prefix}-gateway", f"{prefix}-worker"} <= names
    # Service names are DNS labels (63); other names DNS subdomains (253).
    assert all(len(d["metadata"]["name"]) <= 63 for d in docs if d["kind"] == "Service")
    assert all(len(n) <= 253 for n in names)


def test_one_object_per_template_file_with_a_component_prefix() -> None:
    proc = helm(*template_args(PRESETS["default"], EVERYTHING, MONITORING_APIS))
    sources = re.findall(r"^# Source: dflash-serving/templates/(\S+)$", proc.stdout, re.M)
    assert len(sources) == len(set(sources)) >= 15
    templates = CHART / "templates"
    files = sorted(str(p.relative_to(templates)) for p in templates.rglob("*.yaml"))
    optional = {  # rendered by the tests below with their own values
        "gateway-httproute.yaml",
        "worker-hpa.yaml",
        "worker-leaderworkerset.yaml",
        "worker-modelcache-pvc.yaml",
        "worker-scaledobject.yaml",
        "worker-trtllm-configmap.yaml",  # test_chart_engines.py
        "inference-httproute.yaml",  # test_chart_inference_gateway.py
        "inference-pool.yaml",
        "tests/inference-test-chat.yaml",
        "capture-pvc.yaml",  # test_chart_capture.py
        "capture-adapt-job.yaml",
        "capture-adapt-serviceaccount.yaml",
    }
    assert sorted([*sources, *optional]) == files  # everything rendered once, nothing extra
    assert all(
        f.split("/")[-1].startswith(
            ("gateway-", "worker-", "monitoring-", "redis-", "inference-", "capture-")
        )
        for f in files
    )


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


TEN_MINUTES = 600


def gateway_request_timeout(docs: list[dict[str, Any]]) -> int:
    return int(find(docs, "ConfigMap", "-gateway")["data"]["DFLASH_GATEWAY_REQUEST_TIMEOUT_S"])


def test_gke_keeps_a_ten_minute_stream_open() -> None:
    docs = render(("ci/gke-b200-values.yaml",))
    limit = gateway_request_timeout(docs)
    assert limit > TEN_MINUTES
    policy = find(docs, "GCPBackendPolicy")
    assert policy["apiVersion"] == "networking.gke.io/v1"
    gateway_service = find(docs, "Service", "-gateway")["metadata"]["name"]
    assert policy["spec"]["targetRef"] == {"group": "", "kind": "Service", "name": gateway_service}
    assert policy["spec"]["default"]["timeoutSec"] == limit + 30
    route = find(docs, "HTTPRoute")
    assert route["spec"]["rules"][0]["timeouts"]["request"] == f"{limit + 30}s"


def test_eks_alb_idle_timeout_outlasts_the_gateway() -> None:
    docs = render(("ci/eks-b200-values.yaml",))
    annotations = find(docs, "Ingress")["metadata"]["annotations"]
    attributes = annotations["alb.ingress.kubernetes.io/load-balancer-attributes"]
    idle = int(attributes.removeprefix("idle_timeout.timeout_seconds="))
    assert idle == gateway_request_timeout(docs) + 30 and TEN_MINUTES < idle <= 4000
    assert annotations["alb.ingress.kubernetes.io/scheme"] == "internal"  # the user's kept


def test_nginx_read_and_send_timeouts_outlast_the_gateway() -> None:
    docs = render(("ci/gpu-operator-b300-values.yaml",))
    annotations = find(docs, "Ingress")["metadata"]["annotations"]
    limit = gateway_request_timeout(docs)
    for name in ("proxy-read-timeout", "proxy-send-timeout"):
        assert int(annotations[f"nginx.ingress.kubernetes.io/{name}"]) == limit + 30
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert annotations["nginx.ingress.kubernetes.io/proxy-body-size"] == "4m"  # the user's kept


def test_the_users_own_timeout_annotation_wins_and_one_value_moves_them_all() -> None:
    docs = render(
        ("ci/gpu-operator-b300-values.yaml",),
        ("gateway.requestTimeoutSeconds=1800",),
        set_json=(
            'gateway.ingress.annotations={"nginx.ingress.kubernetes.io/proxy-send-timeout": "99"}',
        ),
    )
    annotations = find(docs, "Ingress")["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"] == "1830"
    assert annotations["nginx.ingress.kubernetes.io/proxy-send-timeout"] == "99"
    assert gateway_request_timeout(docs) == 1800
