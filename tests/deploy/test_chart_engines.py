"""The chart's SGLang and TensorRT-LLM workers (mode, or a pool's engine): each pod runs the
engine's own image with exactly what `dflash-worker --backend sglang|trtllm` builds from the
same settings; SGLang's own parser accepts the chart's argv, TensorRT-LLM's options pass the
schema written from its DFlashDecodingConfig; Prometheus scrapes each engine at its path; the
gateway speaks each pool's engine; autoscaling reads each engine's queue; what an engine cannot
do fails at `helm template`, naming the value."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from engine.worker.settings import BUNDLED_PORTABLE_DRAFTER, BUNDLED_TARGET
from service.settings import GatewaySettings
from tests.deploy.chart import ROOT, find, helm, render, template_args
from tests.fixtures.sglang_parser import parse_with_sglang, require_sglang_env
from tests.fixtures.worker import worker_dry_run

KEY = "wk-test-key-0123456789"
NO_KEY = ("worker.requireApiKey=false",)
SCHEMA = ROOT / "tests" / "fixtures" / "trtllm_dflash_llm_api.schema.json"
MIXED = ("ci/mixed-engines-values.yaml",)


def container(docs: list[dict[str, Any]], suffix: str = "-worker") -> dict[str, Any]:
    pod = find(docs, "Deployment", suffix)["spec"]["template"]
    c: dict[str, Any] = pod["spec"]["containers"][0]
    return c


def argv(c: dict[str, Any]) -> list[str]:
    """command + args as the kubelet runs them (the worker key substituted)."""
    return [str(a).replace("$(DFLASH_WORKER_API_KEY)", KEY) for a in c["command"] + c["args"]]


def translated(backend: str, sets: tuple[str, ...]) -> str:
    """`dflash-worker --backend BACKEND <the chart's vLLM-mode worker args> --dry-run`: the
    same values rendered for our own image, translated by the worker itself."""
    ours = argv(container(render(sets=sets)))
    assert ours[:3] == ["dflash-worker", "--backend", "vllm"]
    return worker_dry_run("--backend", backend, *ours[3:])


def test_sglang_pod_runs_what_the_worker_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(sets=("mode=sglang",))
    # No pools list: the gateway's one pool speaks SGLang.
    config = find(docs, "ConfigMap", "-gateway")["data"]
    monkeypatch.setenv("DFLASH_GATEWAY_POOLS", config["DFLASH_GATEWAY_POOLS"])
    (pool,) = GatewaySettings().pool_specs()
    assert (pool.name, pool.engine, pool.model) == ("default", "sglang", "qwen3-8b-dflash")
    c = container(docs)
    assert c["image"] == "lmsysorg/sglang:v0.5.23"
    expected = json.loads(translated("sglang", ()))
    assert argv(c) == [a if a != "<redacted>" else KEY for a in expected]
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000}


def test_trtllm_pod_runs_what_the_worker_builds() -> None:
    docs = render(sets=("mode=trtllm", *NO_KEY))
    c = container(docs)
    assert c["image"] == "nvcr.io/nvidia/tensorrt-llm/release:1.4.0rc1"
    dry = translated("trtllm", NO_KEY)
    line, document = dry.split("\n---\n", 1)
    expected = json.loads(line)
    path = "/etc/dflash-trtllm/llm-api-options.yaml"
    expected[expected.index("--extra_llm_api_options") + 1] = path
    assert argv(c) == expected
    # The options file: the worker's YAML, mounted from the pool's ConfigMap, valid for
    # TensorRT-LLM's LLM API (schema from its DFlashDecodingConfig).
    config = find(docs, "ConfigMap", "-worker-trtllm")
    options = yaml.safe_load(config["data"]["llm-api-options.yaml"])
    assert options == yaml.safe_load(document)
    jsonschema.validate(options, json.loads(SCHEMA.read_text()))
    assert options["speculative_config"]["decoding_type"] == "DFlash"
    mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["trtllm-options"]
    assert mount == str(Path(path).parent)
    pod = find(docs, "Deployment", "-worker")["spec"]["template"]
    assert pod["metadata"]["labels"]["dflash-serving/engine"] == "trtllm"
    assert "checksum/trtllm-options" in pod["metadata"]["annotations"]


def test_trtllm_options_take_extra_keys_and_roll_the_pods() -> None:
    def rendered(*sets: str) -> tuple[dict[str, Any], str]:
        docs = render(sets=("mode=trtllm", *NO_KEY, *sets))
        options = yaml.safe_load(find(docs, "ConfigMap", "-trtllm")["data"]["llm-api-options.yaml"])
        pod = find(docs, "Deployment", "-worker")["spec"]["template"]
        return options, pod["metadata"]["annotations"]["checksum/trtllm-options"]

    base, before = rendered()
    more, after = rendered("trtllm.extraLlmApiOptions.cuda_graph_config.max_batch_size=64")
    assert more == {**base, "cuda_graph_config": {"max_batch_size": 64}}
    assert before != after


def test_sglangs_own_parser_accepts_the_charts_argv(tmp_path: Path) -> None:
    """The chart's argv for the bundled pair (its portable drafter), through SGLang 0.5.23."""
    require_sglang_env()
    sets = (
        "mode=sglang",
        f"model.name={BUNDLED_TARGET}",
        f"model.speculative.drafter={BUNDLED_PORTABLE_DRAFTER}",
        "model.servedModelName=tiny-coder",
        "worker.maxModelLen=1024",
    )
    dflash = argv(container(render(sets=sets)))
    plain = argv(container(render(sets=(*sets, "model.speculative.enabled=false"))))
    k7 = argv(container(render(sets=(*sets, "model.speculative.numSpeculativeTokens=7"))))
    assert dflash[:3] == ["python3", "-m", "sglang.launch_server"]
    results = parse_with_sglang({"dflash": dflash[3:], "plain": plain[3:], "k7": k7[3:]}, tmp_path)
    for name in ("dflash", "plain", "k7"):
        assert "error" not in results[name], (name, results[name])
        assert results[name]["served_model_name"] == "tiny-coder"
        assert results[name]["context_length"] == 1024
        assert results[name]["api_key"] == KEY
        assert results[name]["enable_metrics"] is True
    assert results["dflash"]["speculative_algorithm"] == "DFLASH"
    assert results["dflash"]["speculative_num_draft_tokens"] == 16
    assert results["k7"]["speculative_num_draft_tokens"] == 8
    assert results["plain"]["speculative_algorithm"] in (None, "NONE")


def test_mixed_fleet_pools_each_speak_their_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(values=MIXED)
    config = find(docs, "ConfigMap", "-gateway")["data"]
    pools = json.loads(config["DFLASH_GATEWAY_POOLS"])
    assert {p["name"]: p["engine"] for p in pools} == {
        "vllm": "vllm",
        "sglang": "sglang",
        "trtllm": "trtllm",
    }
    # The gateway takes the list as it is rendered.
    monkeypatch.setenv("DFLASH_GATEWAY_POOLS", config["DFLASH_GATEWAY_POOLS"])
    specs = GatewaySettings().pool_specs()
    assert [p.engine for p in specs] == ["vllm", "sglang", "trtllm"]
    commands = {
        d["metadata"]["name"].rsplit("-", 1)[1]: d["spec"]["template"]["spec"]["containers"][0][
            "command"
        ]
        for d in docs
        if d["kind"] == "Deployment" and "-worker-" in d["metadata"]["name"]
    }
    assert commands == {
        "vllm": ["dflash-worker"],
        "sglang": ["python3", "-m", "sglang.launch_server"],
        "trtllm": ["trtllm-serve"],
    }


def test_each_engine_is_scraped_at_its_path() -> None:
    docs = render(values=MIXED, sets=("monitoring.serviceMonitor.enabled=true",))
    endpoints = find(docs, "PodMonitor")["spec"]["podMetricsEndpoints"]
    by_path = {e["path"]: e["relabelings"] for e in endpoints}
    assert set(by_path) == {"/metrics", "/prometheus/metrics"}
    engine = "__meta_kubernetes_pod_label_dflash_serving_engine"
    for path, action in (("/metrics", "drop"), ("/prometheus/metrics", "keep")):
        rule = next(r for r in by_path[path] if r["sourceLabels"] == [engine])
        assert (rule["regex"], rule["action"]) == ("trtllm", action)
        assert any(r.get("targetLabel") == "pool" for r in by_path[path])
    # Without TensorRT-LLM: one path, as before.
    plain = render(sets=("monitoring.serviceMonitor.enabled=true",))
    assert [e["path"] for e in find(plain, "PodMonitor")["spec"]["podMetricsEndpoints"]] == [
        "/metrics"
    ]


def test_autoscaling_reads_each_engines_queue() -> None:
    sets = (
        "worker.autoscaling.enabled=true",
        "worker.autoscaling.driver=keda",
        "worker.autoscaling.keda.prometheusAddress=http://prometheus:9090",
    )
    docs = render(values=MIXED, sets=sets)
    queries = {
        d["metadata"]["name"].rsplit("-", 1)[1]: d["spec"]["triggers"][0]["metadata"]["query"]
        for d in docs
        if d["kind"] == "ScaledObject"
    }
    assert queries["vllm"].startswith("sum(vllm:num_requests_waiting{")
    # Either spelling: a Prometheus 2 scrape of SGLang escapes ':' to '_'.
    assert queries["sglang"].startswith('sum({__name__=~"sglang[:_]num_queue_reqs",')
    assert queries["sglang"].endswith(',priority=""})')  # the total over priorities
    assert queries["trtllm"].startswith("sum(trtllm_num_requests_waiting{")
    for pool, query in queries.items():
        assert f'pool="{pool}"' in query


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("mode=trtllm",), "mode trtllm: trtllm-serve takes no API key"),
        (
            ("mode=sglang", "worker.multiNode.enabled=true"),
            "mode sglang: worker.multiNode (LeaderWorkerSet) is rendered for vLLM only",
        ),
        (
            (
                "mode=sglang",
                "worker.autoscaling.enabled=true",
                "worker.autoscaling.driver=hpa",
            ),
            "mode sglang: worker.autoscaling.hpa.waitingMetricName",
        ),
        (("mode=tgi",), "mode must be one of the following"),
    ],
)
def test_what_an_engine_cannot_do_fails_naming_the_value(
    sets: tuple[str, ...], message: str
) -> None:
    proc = helm(*template_args(sets=sets))
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_a_pools_engine_is_named_in_its_refusal() -> None:
    pools = [{"name": "fast", "engine": "trtllm"}]
    proc = helm(*template_args(set_json=(f"pools={json.dumps(pools)}",)))
    assert proc.returncode != 0
    assert "pools[fast].engine trtllm: trtllm-serve takes no API key" in proc.stderr


@pytest.mark.parametrize("mode", ["vllm", "sglang", "trtllm", "embedded"])
def test_tracing_reaches_the_gateway_and_every_engine(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """tracing.* (docs/tracing.md): OTEL_* on the gateway's and the engine's pods, and the
    engine's own flag exactly as `dflash-worker --dry-run` builds it from that environment."""
    sets = (
        f"mode={mode}",
        *NO_KEY,
        "tracing.endpoint=http://otel.obs:4318",
        "tracing.protocol=http/protobuf",
        "tracing.resourceAttributes=deployment.environment=prod",
    )
    docs = render(sets=sets, set_json=("tracing.samplerArg=0.01",))
    gateway_env = {e["name"]: e.get("value") for e in container(docs, "-gateway")["env"]}
    assert gateway_env["OTEL_SERVICE_NAME"] == "dflash-gateway"
    c = container(docs)
    env = {e["name"]: e.get("value") for e in c["env"] if e["name"].startswith("OTEL_")}
    assert env["OTEL_SERVICE_NAME"] == "dflash-worker"
    assert {k: v for k, v in gateway_env.items() if k.startswith("OTEL_")} == {
        **env,
        "OTEL_SERVICE_NAME": "dflash-gateway",
    }
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel.obs:4318"
    assert env["OTEL_TRACES_SAMPLER_ARG"] == "0.01"
    assert env["OTEL_RESOURCE_ATTRIBUTES"] == "deployment.environment=prod"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    url = "http://otel.obs:4318/v1/traces"
    if mode == "embedded":  # the worker reads the environment itself
        return
    if mode == "vllm":
        ours = argv(c)
        dry = json.loads(worker_dry_run(*ours[1:]))
        assert dry[dry.index("--otlp-traces-endpoint") + 1] == url
        return
    if mode == "sglang":
        assert argv(c) == json.loads(translated("sglang", NO_KEY))
        assert argv(c)[argv(c).index("--otlp-traces-endpoint") + 1] == url
        return
    options = yaml.safe_load(find(docs, "ConfigMap", "-trtllm")["data"]["llm-api-options.yaml"])
    assert options == yaml.safe_load(translated("trtllm", NO_KEY).split("\n---\n", 1)[1])
    assert options["otlp_traces_endpoint"] == url


def test_a_dflash2_drafter_on_every_engine_that_serves_it() -> None:
    """model.speculative.method dflash2 (docs/worker.md, DFlash2 drafters): dflash-worker gets
    it as given; `vllm serve` itself and SGLang get DFlash's flags (they read the kind from
    the drafter's architecture); TensorRT-LLM refuses it, naming the value."""
    import json as _json

    from tests.deploy.chart import find, helm, render, template_args

    docs = render(("ci/dflash2-b200-values.yaml",))
    args = find(docs, "Deployment", "-worker")["spec"]["template"]["spec"]["containers"][0]["args"]
    spec = _json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {
        "method": "dflash2",
        "model": "z-lab/Qwen3.8-27B-DFlash2",
        "num_speculative_tokens": 7,
    }
    direct = render(("ci/dflash2-b200-values.yaml",), ("worker.launcher=vllm",))
    args = find(direct, "Deployment", "-worker")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert _json.loads(args[args.index("--speculative-config") + 1])["method"] == "dflash"
    sglang = render(("ci/dflash2-b200-values.yaml",), ("mode=sglang",))
    args = find(sglang, "Deployment", "-worker")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert args[args.index("--speculative-algorithm") + 1] == "DFLASH"
    refused = helm(*template_args(("ci/dflash2-b200-values.yaml",), ("mode=trtllm",)))
    assert refused.returncode != 0 and "model.speculative.method: dflash2" in refused.stderr
