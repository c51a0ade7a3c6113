"""The gateway's rendered settings (ConfigMap env + container args + API-key Secret) are what
the real `dflash-gateway` parses into its settings object."""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import pytest

from service.cli import settings_from_args
from service.settings import GatewaySettings
from tests.deploy.chart import find, render
from tests.fixtures.keys import keys_of


def secret_value(docs: list[dict[str, Any]], ref: dict[str, str]) -> str:
    """What the kubelet puts in an env var with this secretKeyRef."""
    secret = find(docs, "Secret", ref["name"])
    return base64.b64decode(secret["data"][ref["key"]]).decode()


def gateway_settings(
    docs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> GatewaySettings:
    env = find(docs, "ConfigMap", "-gateway")["data"]
    assert all(key.startswith("DFLASH_GATEWAY_") for key in env)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    c = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    resolved: dict[str, str] = {}
    for var in c.get("env", []):  # as the kubelet resolves it: Secrets, then $(NAME)s
        if "valueFrom" in var:
            value = secret_value(docs, var["valueFrom"]["secretKeyRef"])
        else:
            value = re.sub(r"\$\((\w+)\)", lambda m: resolved[m.group(1)], var["value"])
        resolved[var["name"]] = value
        monkeypatch.setenv(var["name"], value)
    assert c["command"] == ["dflash-gateway"]
    return settings_from_args([str(a) for a in c["args"]])


def test_every_rendered_setting_is_a_gateway_setting() -> None:
    docs = render(
        sets=("gateway.extraSettings.max_retries=4", "gateway.extraSettings.shutdown_delay_s=2")
    )
    fields = {f"DFLASH_GATEWAY_{name.upper()}" for name in GatewaySettings.model_fields}
    keys = set(find(docs, "ConfigMap", "-gateway")["data"])
    assert keys <= fields, keys - fields  # pydantic-settings would ignore a misspelled one


def test_gateway_reads_the_rendered_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    docs = render(
        sets=(
            "gateway.routingPolicy=prefix_affinity",
            "gateway.extraSettings.max_retries=4",
            "gateway.metricsRequireAuth=true",
        ),
        set_json=('gateway.apiKeys.keys=["sk-one-1234","sk-two-5678"]',),
    )
    s = gateway_settings(docs, monkeypatch)
    assert (s.host, s.port) == ("0.0.0.0", 8000)
    assert s.worker_dns == "rel-dflash-serving-worker.llm.svc.cluster.local:8000"
    assert s.routing == "prefix_affinity" and s.max_retries == 4 and s.metrics_auth is True
    assert s.drain_timeout_s == 30.0 and s.dns_interval_s == 5.0
    assert s.processes == 1
    # The key file path is where the Secret is mounted; its content is the rendered Secret.
    c = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["api-keys"]
    assert str(s.api_key_file) == f"{mount}/api-keys"
    secret = find(docs, "Secret", "-gateway-api-keys")["data"]["api-keys"]
    (tmp_path / "api-keys").write_bytes(base64.b64decode(secret))
    local = s.model_copy(update={"api_key_file": tmp_path / "api-keys"})
    assert keys_of(local.load_key_ring(), ["sk-one-1234", "sk-two-5678", "sk-three"]) == [
        "sk-one-1234",
        "sk-two-5678",
    ]
    # A generated worker key, never one of the client keys.
    assert s.worker_api_key and s.worker_api_key.startswith("wk-dflash-")


def test_auth_off_renders_no_key_file(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(sets=("gateway.apiKeys.enabled=false", "worker.requireApiKey=false"))
    s = gateway_settings(docs, monkeypatch)
    assert s.api_key_file is None and not s.load_key_ring().by_digest
    assert s.worker_api_key is None


def test_gateway_sends_the_key_the_workers_require(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(sets=("gateway.apiKeys.workerKey=wk-test-0123456789",))
    s = gateway_settings(docs, monkeypatch)
    assert s.worker_api_key == "wk-test-0123456789"
    worker = find(docs, "Deployment", "-worker")["spec"]["template"]["spec"]["containers"][0]
    ref = next(e for e in worker["env"] if e["name"] == "DFLASH_WORKER_API_KEY")
    assert secret_value(docs, ref["valueFrom"]["secretKeyRef"]) == s.worker_api_key


def test_gateway_reuses_worker_connections_for_less_than_the_workers_keep_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for sets in ((), ("worker.httpKeepAliveSeconds=5",)):
        docs = render(sets=sets)
        s = gateway_settings(docs, monkeypatch)
        worker = find(docs, "Deployment", "-worker")["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in worker["env"]}
        worker_s = int(env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"])
        assert worker_s == (5 if sets else 61)
        assert s.upstream_keepalive_s == worker_s - 1


def test_gateway_processes_per_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    s = gateway_settings(render(sets=("gateway.processes=4",)), monkeypatch)
    assert s.processes == 4 and s.port == 8000  # a fixed port, as --processes needs
