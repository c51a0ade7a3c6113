"""The chart's traffic capture and adapt job (docs/capture.md), rendered by the real helm: off
by default; a claim or a bucket; credentials from a Secret or workload identity; the adapt Job
or CronJob on a GPU node writing into the shared model cache; what it refuses. The ci/capture-*
examples (GKE, EKS) are validated strictly with every other ci/ file (test_chart_manifests.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.deploy.chart import find, helm, render, template_args
from tests.deploy.test_chart_manifests import PRESETS

SHARED = ("worker.modelCache.type=shared",)


def gateway_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]
    container: dict[str, Any] = pod["containers"][0]
    return container


def settings(docs: list[dict[str, Any]]) -> dict[str, str]:
    data: dict[str, str] = find(docs, "ConfigMap", "-gateway")["data"]
    return data


def test_capture_is_off_by_default() -> None:
    docs = render()
    assert not any(k.startswith("DFLASH_GATEWAY_CAPTURE") for k in settings(docs))
    assert not [d for d in docs if d["metadata"]["name"].endswith(("-capture", "-adapt"))]


def test_a_claim_shared_by_every_gateway_pod_when_no_bucket_is_given() -> None:
    docs = render(sets=("capture.enabled=true", "capture.persistence.size=20Gi"))
    claim = find(docs, "PersistentVolumeClaim", "-capture")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert settings(docs)["DFLASH_GATEWAY_CAPTURE_URI"] == "/var/lib/dflash/capture"
    mount = {m["name"]: m for m in gateway_container(docs)["volumeMounts"]}["capture"]
    assert mount["mountPath"] == "/var/lib/dflash/capture"
    volumes = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["volumes"]
    assert {
        "name": "capture",
        "persistentVolumeClaim": {"claimName": "rel-dflash-serving-capture"},
    } in volumes


def test_a_bucket_with_credentials_from_a_secret_and_the_limits() -> None:
    docs = render(
        sets=(
            "capture.enabled=true",
            "capture.uri=s3://bucket/traffic",
            "capture.existingSecret=aws-capture",
            "capture.env.AWS_REGION=eu-west-1",
            "capture.retentionSeconds=3600",
        )
    )
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    values = settings(docs)
    assert values["DFLASH_GATEWAY_CAPTURE_URI"] == "s3://bucket/traffic"
    assert values["DFLASH_GATEWAY_CAPTURE_RETENTION_S"] == "3600"
    assert values["DFLASH_GATEWAY_CAPTURE_MAX_BYTES"] == "10737418240"
    container = gateway_container(docs)
    assert {"secretRef": {"name": "aws-capture"}} in container["envFrom"]
    assert {"name": "AWS_REGION", "value": "eu-west-1"} in container["env"]


def test_a_pools_capture_share_reaches_the_gateway() -> None:
    pools = json.dumps(
        [{"name": "base", "weight": 90}, {"name": "canary", "weight": 10, "capture": False}]
    )
    docs = render(sets=("capture.enabled=true",), set_json=(f"pools={pools}",))
    specs = {p["name"]: p for p in json.loads(settings(docs)["DFLASH_GATEWAY_POOLS"])}
    assert specs["canary"]["capture"] is False and "capture" not in specs["base"]


def test_the_adapt_job_runs_on_a_gpu_and_writes_into_the_model_cache() -> None:
    docs = render(sets=("capture.enabled=true", "capture.adapt.enabled=true", *SHARED))
    job = find(docs, "Job", "-adapt-1")
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    script = container["args"][0]
    assert "dflash-train adapt --device cuda" in script
    assert "--out /cache/drafters/adapted" in script
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["CAPTURE_URI"] == "/var/lib/dflash/capture"
    assert env["TARGET"] == "Qwen/Qwen3-8B" and env["DRAFTER"] == "z-lab/Qwen3-8B-DFlash-b16"
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["capture"]["readOnly"] is True and mounts["model-cache"]["mountPath"] == "/cache"
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
    assert claims == {
        "model-cache": "rel-dflash-serving-worker-model-cache",
        "capture": "rel-dflash-serving-capture",
    }
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert pod["serviceAccountName"] == "rel-dflash-serving-adapt"
    find(docs, "ServiceAccount", "-adapt")


def test_a_schedule_makes_it_a_cronjob() -> None:
    docs = render(
        sets=(
            "capture.enabled=true",
            "capture.adapt.enabled=true",
            "capture.adapt.schedule=0 3 * * *",
            *SHARED,
        )
    )
    cron = find(docs, "CronJob", "-adapt")
    assert cron["spec"]["schedule"] == "0 3 * * *"
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    assert not [d for d in docs if d["kind"] == "Job"]


@pytest.mark.parametrize(
    "sets, message",
    [
        (("capture.adapt.enabled=true",), "worker.modelCache.type: shared"),
        (
            ("capture.adapt.enabled=true", *SHARED, "worker.modelCache.readOnly=true"),
            "readOnly must be false",
        ),
        (("capture.uri=http://example.com/x",), "capture.uri"),
        (("capture.adapt.outputPath=../escape",), "outputPath"),
        (("capture.shardBytes=10",), "shardBytes"),
    ],
)
def test_what_the_chart_refuses(sets: tuple[str, ...], message: str) -> None:
    proc = helm(*template_args(sets=("capture.enabled=true", *sets)))
    assert proc.returncode != 0
    assert message in proc.stderr


def test_the_adapt_job_without_capture_is_refused() -> None:
    """It would render nothing and say nothing: the job trains on the captured dataset."""
    proc = helm(*template_args(sets=("capture.adapt.enabled=true", *SHARED)))
    assert proc.returncode != 0 and "capture.adapt.enabled needs capture.enabled" in proc.stderr


def test_the_ci_examples_capture_on_gke_and_eks() -> None:
    gke = render(PRESETS["ci/capture-gke-values.yaml"])
    assert settings(gke)["DFLASH_GATEWAY_CAPTURE_URI"] == "gs://my-project-dflash/capture"
    cron = find(gke, "CronJob", "-adapt")
    annotations = find(gke, "ServiceAccount", "-adapt")["metadata"]["annotations"]
    assert "iam.gke.io/gcp-service-account" in annotations
    assert cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["nodeSelector"] == {
        "cloud.google.com/gke-accelerator": "nvidia-b200"
    }
    eks = render(PRESETS["ci/capture-eks-values.yaml"])
    assert settings(eks)["DFLASH_GATEWAY_CAPTURE_URI"] == "s3://my-dflash-bucket/capture"
    gateway_sa = find(eks, "ServiceAccount", "-gateway")["metadata"]["annotations"]
    assert gateway_sa == {
        "eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/dflash-capture"
    }
    find(eks, "Job", "-adapt-1")


def test_a_pools_promotion_reaches_the_gateway_and_the_gateway_takes_it() -> None:
    from service.settings import GatewaySettings

    pools = json.dumps(
        [
            {"name": "base"},
            {"name": "canary", "promotion": {"baseline": "base", "stages": [5, 50, 100]}},
        ]
    )
    docs = render(set_json=(f"pools={pools}",))
    raw = settings(docs)["DFLASH_GATEWAY_POOLS"]
    specs = {p["name"]: p for p in json.loads(raw)}
    assert specs["canary"]["promotion"] == {"baseline": "base", "stages": [5, 50, 100]}
    assert "weight" not in specs["canary"] and "weight" not in specs["base"]
    parsed = GatewaySettings(pools=json.loads(raw))  # what the gateway reads from its env
    assert parsed.pools[1].promotion is not None
    assert parsed.pools[1].promotion.stages == (5.0, 50.0, 100.0)
