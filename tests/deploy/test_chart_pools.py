"""The chart's `pools:`: each pool renders its own workers from the release's values with its
own keys merged over them; the gateway gets one entry per pool; values without `pools:` render
the workers chart 0.2.0 rendered; bad pools lists fail at `helm template` naming the value."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from service.settings import GatewaySettings
from tests.deploy.chart import CHART, ROOT, helm, render, template_args

SNAPSHOT = ROOT / "tests" / "fixtures" / "chart-0.2.0-workers.yaml"
PLATFORMS = {
    "gke": "ci/gke-b200-values.yaml",
    "eks": "ci/eks-b200-values.yaml",
    "gpu-operator": "ci/gpu-operator-b300-values.yaml",
}
POOLS = [
    {"name": "main", "weight": 90},
    {
        "name": "canary",
        "weight": 10,
        "model": {"speculative": {"drafter": "acme/Qwen3-8B-DFlash-ours"}},
        "worker": {"replicas": 1},
    },
    {
        "name": "coder",
        "gpu": "b300",
        "model": {
            "name": "Qwen/Qwen3-Coder-30B-A3B-Instruct",
            "servedModelName": "qwen3-coder",
            "speculative": {"drafter": "z-lab/Qwen3-Coder-30B-A3B-DFlash"},
        },
        "worker": {"replicas": 3, "autoscaling": {"enabled": False}},
    },
]
WORKER_KINDS = ("Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy")


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def worker_objects(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    kept = []
    for doc in docs:
        if "-worker" in doc["metadata"]["name"]:
            labels = doc["metadata"].get("labels", {})
            labels.pop("helm.sh/chart", None)
            labels.pop("app.kubernetes.io/version", None)
            kept.append(doc)
    return sorted(kept, key=lambda d: (d["kind"], d["metadata"]["name"]))


def argv(deployment: dict[str, Any]) -> list[str]:
    args: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("count", [1, 2, 3])
@pytest.mark.parametrize("platform", list(PLATFORMS))
def test_each_pool_renders_its_own_workers(
    platform: str, count: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    values = tmp_path / "pools.yaml"
    values.write_text(yaml.safe_dump({"pools": POOLS[:count], "networkPolicy": {"enabled": True}}))
    args = template_args((PLATFORMS[platform],))
    proc = helm(*args, "-f", str(values))
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    lint = helm(
        "lint", "--strict", str(CHART), "-f", str(CHART / PLATFORMS[platform]), "-f", str(values)
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    for doc in docs:
        if doc["kind"] in {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"}:
            kubernetes_validate.validate(doc, "1.37", strict=True)
    for pool in POOLS[:count]:
        name = f"rel-dflash-serving-worker-{pool['name']}"
        for kind in WORKER_KINDS:
            named(docs, kind, name)
        deployment = named(docs, "Deployment", name)
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector["dflash-serving/pool"] == pool["name"]
        assert named(docs, "Service", name)["spec"]["clusterIP"] == "None"
        assert named(docs, "Service", name)["spec"]["selector"] == selector
        assert (
            named(docs, "PodDisruptionBudget", name)["spec"]["selector"]["matchLabels"] == selector
        )
        policy = named(docs, "NetworkPolicy", name)["spec"]["podSelector"]["matchExpressions"]
        assert {"key": "dflash-serving/pool", "operator": "In", "values": [pool["name"]]} in policy
    assert not [
        d
        for d in docs
        if d["metadata"]["name"] == "rel-dflash-serving-worker" and d["kind"] in WORKER_KINDS
    ]
    # The gateway reads one pool per entry, each found through its own headless Service.
    env = named(docs, "ConfigMap", "rel-dflash-serving-gateway")["data"]
    assert "DFLASH_GATEWAY_WORKER_DNS" not in env
    monkeypatch.setenv("DFLASH_GATEWAY_POOLS", env["DFLASH_GATEWAY_POOLS"])
    specs = GatewaySettings().pool_specs()
    assert [(s.name, s.worker_dns) for s in specs] == [
        (p["name"], f"rel-dflash-serving-worker-{p['name']}.llm.svc.cluster.local:8000")
        for p in POOLS[:count]
    ]
    gateway = named(docs, "Deployment", "rel-dflash-serving-gateway")
    assert "--worker-dns" not in argv(gateway)


def test_pool_values_merge_over_the_release_values() -> None:
    docs = render(("ci/gke-b200-values.yaml",), set_json=(f"pools={json.dumps(POOLS)}",))
    main, canary, coder = (
        named(docs, "Deployment", f"rel-dflash-serving-worker-{p}")
        for p in ("main", "canary", "coder")
    )
    # The canary differs from main in its drafter and replicas only.
    assert json.loads(flag(argv(canary), "--speculative-config"))["model"] == (
        "acme/Qwen3-8B-DFlash-ours"
    )
    assert (main["spec"]["replicas"], canary["spec"]["replicas"]) == (2, 1)
    assert flag(argv(main), "--served-model-name") == flag(argv(canary), "--served-model-name")
    # The coder pool: its own model, and the B300 preset's sizing under its own values.
    assert flag(argv(coder), "--served-model-name") == "qwen3-coder"
    assert "Qwen/Qwen3-Coder-30B-A3B-Instruct" in argv(coder)
    assert "Qwen/Qwen3-8B" in argv(main) and "Qwen/Qwen3-8B" in argv(canary)
    b300 = yaml.safe_load((CHART / "values-b300.yaml").read_text())["worker"]
    assert flag(argv(coder), "--max-model-len") == str(b300["maxModelLen"])
    assert coder["spec"]["replicas"] == 3
    env = named(docs, "ConfigMap", "rel-dflash-serving-gateway")["data"]
    pools = json.loads(env["DFLASH_GATEWAY_POOLS"])
    # A weight the values leave out stays out: the gateway's default, 100.
    assert [(p["model"], p.get("weight")) for p in pools] == [
        ("qwen3-8b-dflash", 90),
        ("qwen3-8b-dflash", 10),
        ("qwen3-coder", None),
    ]


def test_a_pool_changes_nothing_but_its_names_and_pool_label() -> None:
    legacy = render(("ci/eks-b200-values.yaml",))
    pooled = render(("ci/eks-b200-values.yaml",), set_json=('pools=[{"name": "only"}]',))
    text = json.dumps(named(pooled, "Deployment", "rel-dflash-serving-worker-only"))
    text = text.replace("rel-dflash-serving-worker-only", "rel-dflash-serving-worker")
    deployment = json.loads(text)
    for where in (
        deployment["spec"]["selector"]["matchLabels"],
        deployment["metadata"]["labels"],
        deployment["spec"]["template"]["metadata"]["labels"],
    ):
        assert where.pop("dflash-serving/pool") == "only"
    affinity = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = affinity["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    term["labelSelector"]["matchLabels"].pop("dflash-serving/pool")
    assert deployment == named(legacy, "Deployment", "rel-dflash-serving-worker")


def test_without_pools_the_workers_are_those_of_chart_0_2_0() -> None:
    snapshot = yaml.safe_load(SNAPSHOT.read_text())
    for values, expected in snapshot.items():
        docs = render(() if values == "default" else (values,))
        assert worker_objects(docs) == expected, values


def test_worker_series_carry_the_pool_and_autoscaling_is_per_pool() -> None:
    keda = {
        "enabled": True,
        "driver": "keda",
        "minReplicas": 0,
        "maxReplicas": 4,
        "keda": {"prometheusAddress": "http://prometheus:9090"},
    }
    pools = [{"name": "main"}, {"name": "canary", "weight": 5, "worker": {"autoscaling": keda}}]
    docs = render(
        ("ci/gke-b200-values.yaml",),
        set_json=(f"pools={json.dumps(pools)}",),
        api_versions=("monitoring.coreos.com/v1/PodMonitor", "keda.sh/v1alpha1/ScaledObject"),
    )
    scaled = [d for d in docs if d["kind"] == "ScaledObject"]
    assert [d["metadata"]["name"] for d in scaled] == ["rel-dflash-serving-worker-canary"]
    queries = [t["metadata"]["query"] for t in scaled[0]["spec"]["triggers"]]
    assert 'pool="canary"' in queries[0] and 'pool="canary"' in queries[1]
    assert scaled[0]["spec"]["scaleTargetRef"]["name"] == "rel-dflash-serving-worker-canary"
    monitor = named(docs, "PodMonitor", "rel-dflash-serving-worker")["spec"]
    (relabel,) = monitor["podMetricsEndpoints"][0]["relabelings"]
    assert relabel == {
        "sourceLabels": ["__meta_kubernetes_pod_label_dflash_serving_pool"],
        "targetLabel": "pool",
    }


@pytest.mark.parametrize(
    ("pools", "message"),
    [
        ([{"name": "a"}, {"name": "a"}], 'pools[1].name: "a" is the name of pools[0] too'),
        (
            [{"name": "a", "weight": 0}, {"name": "b", "weight": 0}],
            'every pool serving model "qwen3-8b-dflash" has weight 0',
        ),
        ([{"name": "a", "engine": "tgi"}], "pools.0.engine"),
        ([{"name": "Not_A_Label"}], "pools.0.name"),
        ([{"name": "a", "weight": -1}], "pools.0.weight"),
        ([{"name": "a", "colour": "red"}], "colour"),
        (
            [{"name": "a", "worker": {"modelCache": {"type": "emptyDir"}}}],
            "pools[0].worker.modelCache",
        ),
        ([{"name": "a", "worker": {"replicas": "two"}}], "pools.0.worker.replicas"),
    ],
    ids=["duplicate", "all-zero", "engine", "name", "negative", "unknown-key", "cache", "type"],
)
def test_bad_pools_fail_naming_the_value(pools: list[Any], message: str) -> None:
    proc = helm(*template_args(set_json=(f"pools={json.dumps(pools)}",)))
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
