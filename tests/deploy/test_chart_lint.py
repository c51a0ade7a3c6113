"""`helm lint` and `helm template` for every preset and every ci/ example (chart-testing's
convention); the schema and the template guards reject bad values with a message that names
the value."""

from __future__ import annotations

import pytest

from tests.deploy.chart import CHART, CI_VALUES, helm, template_args

PRESETS = [
    (),
    ("values-b200.yaml",),
    ("values-b300.yaml",),
    ("values-embedded.yaml",),
    *((name,) for name in CI_VALUES),
]
PRESET_IDS = ["default", "b200", "b300", "embedded", *CI_VALUES]
# The examples the chart promises (README "Cluster examples").
REQUIRED_CI = {
    "ci/gke-b200-values.yaml",
    "ci/eks-b200-values.yaml",
    "ci/gpu-operator-b300-values.yaml",
    "ci/autoscaling-keda-values.yaml",
    "ci/autoscaling-hpa-values.yaml",
    "ci/multi-replica-networkpolicy-values.yaml",
    "ci/multinode-lws-values.yaml",
    "ci/embedded-values.yaml",
}


def test_ci_examples_are_all_there() -> None:
    assert set(CI_VALUES) >= REQUIRED_CI
    # chart-testing reads only *-values.yaml: a misnamed example would go untested.
    assert sorted(f"ci/{p.name}" for p in (CHART / "ci").iterdir()) == list(CI_VALUES)


@pytest.mark.parametrize("values", PRESETS, ids=PRESET_IDS)
def test_lint_is_clean(values: tuple[str, ...]) -> None:
    args = ["lint", "--strict", str(CHART)]
    for name in values:
        args += ["-f", str(CHART / name)]
    proc = helm(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("values", PRESETS, ids=PRESET_IDS)
def test_template_renders(values: tuple[str, ...]) -> None:
    proc = helm(*template_args(values))
    assert proc.returncode == 0, proc.stderr
    assert "kind: Deployment" in proc.stdout or "kind: LeaderWorkerSet" in proc.stdout


BAD_VALUES = [
    # (--set or --set-json, expected text in the error)
    (
        "worker.tensorParallelSize=3",
        "worker.tensorParallelSize must be one of the following: 1, 2, 4, 8",
    ),
    ("worker.tensorParallelSize=16", "worker.tensorParallelSize must be one of the following"),
    ("worker.gpu.platform=aks", "worker.gpu.platform must be one of the following"),
    ("worker.modelCache.type=s3", "worker.modelCache.type must be one of the following"),
    ("worker.autoscaling.driver=vpa", "worker.autoscaling.driver must be one of the following"),
    ("worker.multiNode.nodes=1", "worker.multiNode.nodes: Must be greater than or equal to 2"),
    (
        "worker.autoscaling.keda.prometheusAddress=prometheus:9090",
        "worker.autoscaling.keda.prometheusAddress: Does not match pattern",
    ),
    ("worker.tensorParallelSize=0", "worker.tensorParallelSize"),
    ("mode=tpu", 'mode must be one of the following: "vllm", "embedded"'),
    ("worker.tensorParalelSize=2", "Additional property tensorParalelSize is not allowed"),
    (
        "worker.perRequestSpecDecodeMetrics=full",
        "worker.perRequestSpecDecodeMetrics must be one of",
    ),
    (
        "model.speculative.numSpeculativeTokens=0",
        "model.speculative.numSpeculativeTokens: Must be greater than or equal to 1",
    ),
    ("gateway.routingPolicy=random", "gateway.routingPolicy must be one of"),
    ("monitoring.serviceMonitor.enabled=maybe", "monitoring.serviceMonitor.enabled must be one of"),
    ("worker.modelCache.size=lots", "worker.modelCache.size: Does not match pattern"),
    ("gateway.port=70000", "gateway.port: Must be less than or equal to 65535"),
    ("gateway.processes=0", "gateway.processes: Must be greater than or equal to 1"),
    (
        "json:worker.gpuMemoryUtilization=1.5",
        "worker.gpuMemoryUtilization: Must be less than or equal to 1",
    ),
    (
        'json:worker.gpu.nodeLabelValues="NVIDIA-B200"',
        "worker.gpu.nodeLabelValues: Invalid type. Expected: array, given: string",
    ),
    ("worker.gpu.products[0]=NVIDIA-B200", "Additional property products is not allowed"),
    ('json:gateway.apiKeys.keys=["short"]', "String length must be greater than or equal to 8"),
]


@pytest.mark.parametrize(("item", "message"), BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_schema_rejects_bad_values(item: str, message: str) -> None:
    flag = (
        ["--set-json", item.removeprefix("json:")] if item.startswith("json:") else ["--set", item]
    )
    proc = helm("template", "rel", str(CHART), *flag)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert message in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ("worker.terminationGracePeriodSeconds=60",),
            "worker.terminationGracePeriodSeconds (60) must exceed worker.preStopSleepSeconds + "
            "worker.shutdownTimeoutSeconds (70)",
        ),
        (
            ("gateway.terminationGracePeriodSeconds=30",),
            "gateway.terminationGracePeriodSeconds (30) must exceed gateway.preStopSleepSeconds + "
            "gateway.drainTimeoutSeconds (35)",
        ),
        (
            ("worker.preStopSleepSeconds=2",),
            "worker.preStopSleepSeconds (2) must be at least gateway.discoveryIntervalSeconds (5)",
        ),
        (
            ("worker.rollingUpdate.maxSurge=0",),
            "maxSurge and maxUnavailable cannot both be 0",
        ),
        (
            ("model.speculative.numSpeculativeTokens=3",),
            "expectedAcceptanceLength (5) cannot exceed numSpeculativeTokens + 1 (4)",
        ),
        (
            ("worker.autoscaling.enabled=true",),
            "worker.autoscaling.keda.prometheusAddress is required with driver keda",
        ),
        (
            (
                "worker.autoscaling.enabled=true",
                "worker.autoscaling.driver=hpa",
                "worker.autoscaling.minReplicas=0",
            ),
            "minReplicas must be at least 1 with driver hpa",
        ),
        (
            ("gateway.apiKeys.enabled=false",),
            "worker.requireApiKey needs gateway.apiKeys.enabled",
        ),
        (("gateway.httpRoute.enabled=true",), "gateway.httpRoute.parentRefs: name the Gateway"),
        (
            ("gateway.extraSettings.processes=4",),
            "gateway.extraSettings.processes: set by the chart from gateway.processes",
        ),
    ],
    ids=[
        "worker-grace",
        "gateway-grace",
        "worker-prestop-vs-dns",
        "rollout-cannot-start",
        "expected-acceptance-above-k",
        "keda-without-prometheus",
        "hpa-to-zero",
        "worker-key-without-secret",
        "httproute-without-gateway",
        "extra-setting-the-chart-renders",
    ],
)
def test_inconsistent_values_are_rejected(sets: tuple[str, ...], message: str) -> None:
    proc = helm(*template_args(sets=sets))
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_extra_settings_the_chart_does_not_render_are_kept() -> None:
    """With API keys off the chart renders no key file: a user's own one is no duplicate."""
    sets = ("gateway.apiKeys.enabled=false", "worker.requireApiKey=false")
    sets += ("gateway.extraSettings.api_key_file=/etc/keys/k",)
    proc = helm(*template_args(sets=sets))
    assert proc.returncode == 0, proc.stderr
    assert 'DFLASH_GATEWAY_API_KEY_FILE: "/etc/keys/k"' in proc.stdout
