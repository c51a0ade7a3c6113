"""The chart's keys and its `helm test` hook against real processes: an embedded worker started
with the worker key from the rendered Secret (and the rendered keep-alive) refuses requests
without it and closes idle connections when the chart says, the gateway (holding
that key and the client keys, as the chart wires them) serves through it, and the `helm test`
Pod's script passes against that gateway."""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.deploy.chart import CHART, find, helm, render
from tests.deploy.stack import running_gateway
from tests.fixtures.tiny_models import TinyCheckpoint
from tests.fixtures.worker import WorkerHandle, running_worker

MODEL = "tiny"


def secret_data(docs: list[dict[str, Any]], key: str) -> str:
    secret = find(docs, "Secret", "-gateway-api-keys")
    return base64.b64decode(secret["data"][key]).decode()


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return render(
        sets=("worker.httpKeepAliveSeconds=2",),  # short enough to watch the idle close
        set_json=('gateway.apiKeys.keys=["sk-client-one-1234"]',),
    )


@pytest.fixture(scope="module")
def worker(docs: list[dict[str, Any]], tiny_checkpoint: TinyCheckpoint) -> Iterator[WorkerHandle]:
    spec = json.dumps({"method": "dflash", "model": str(tiny_checkpoint.drafter_dir)})
    key = secret_data(docs, "worker-api-key")
    args: tuple[str, ...] = (str(tiny_checkpoint.target_dir), "--speculative-config", spec)
    args += ("--served-model-name", MODEL, "--max-model-len", "256", "--api-key", key)
    container = find(docs, "Deployment", "-worker")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e and e["name"] != "HOME"}
    with running_worker(*args, env=env) as handle:
        yield handle


def test_the_worker_closes_idle_connections_after_the_rendered_keep_alive(
    worker: WorkerHandle,
) -> None:
    """The chart's worker.httpKeepAliveSeconds (2 here) reaches the worker process as
    VLLM_HTTP_TIMEOUT_KEEP_ALIVE: an idle connection lives ~2 s, not uvicorn's default 5."""
    port = int(worker.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: w\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.settimeout(1.0)
        with pytest.raises(TimeoutError):
            sock.recv(1)  # still open after 1 s idle
        sock.settimeout(3.5)
        assert sock.recv(1) == b""  # closed by the worker before 4.5 s


def chat(base: str, key: str | None) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_a_worker_refuses_anyone_without_the_worker_key(
    docs: list[dict[str, Any]], worker: WorkerHandle
) -> None:
    assert chat(worker.base_url, None).status_code == 401
    assert chat(worker.base_url, "sk-client-one-1234").status_code == 401  # a client key
    assert chat(worker.base_url, secret_data(docs, "worker-api-key")).status_code == 200
    assert httpx.get(f"{worker.base_url}/metrics", timeout=10).status_code == 200  # Prometheus


def helm_test_pod_script() -> str:
    """The Python the `helm test` Pod runs (templates/tests/gateway-test-chat.yaml)."""
    proc = helm(
        "template", "rel", str(CHART), "-n", "llm", "--show-only",
        "templates/tests/gateway-test-chat.yaml",
    )  # fmt: skip
    script: str = yaml.safe_load(proc.stdout)["spec"]["containers"][0]["args"][0]
    return script


def run_test_pod(script: str, gateway: str, keys: Path) -> subprocess.CompletedProcess[str]:
    """The Pod's script against a local gateway, with the environment the Pod gets."""
    env = {"URL": gateway, "MODEL": MODEL, "KEY_FILE": str(keys), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )


def test_helm_test_script_passes_through_the_keyed_gateway(
    docs: list[dict[str, Any]],
    worker: WorkerHandle,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gw = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    ref = next(e for e in gw["env"] if e["name"] == "DFLASH_GATEWAY_WORKER_API_KEY")
    monkeypatch.setenv(ref["name"], secret_data(docs, ref["valueFrom"]["secretKeyRef"]["key"]))
    keys = tmp_path / "api-keys"
    keys.write_text(secret_data(docs, "api-keys"))
    script = helm_test_pod_script()
    with running_gateway([worker.base_url], tmp_path, "--api-key-file", str(keys)) as gateway:
        assert chat(gateway, None).status_code == 401
        run = run_test_pod(script, gateway, keys)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "chat completion ok" in run.stdout
    # Without the worker key the same gateway gets nothing from the worker. (Today the
    # gateway relays the worker's 401 to a client whose own key was fine.)
    monkeypatch.delenv(ref["name"])
    with running_gateway([worker.base_url], tmp_path, "--api-key-file", str(keys)) as keyless:
        assert chat(keyless, "sk-client-one-1234").status_code != 200


def test_helm_test_script_reads_a_tenant_key_file(
    docs: list[dict[str, Any]],
    worker: WorkerHandle,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With gateway.apiKeys.tenants the Secret holds YAML: the test Pod takes the first
    tenant's first key, and the gateway limits it (x-ratelimit headers)."""
    tenants = [{"name": "search", "keys": ["sk-search-0001"], "requests_per_minute": 50}]
    with_tenants = render(
        sets=("gateway.replicas=1",), set_json=(f"gateway.apiKeys.tenants={json.dumps(tenants)}",)
    )
    monkeypatch.setenv("DFLASH_GATEWAY_WORKER_API_KEY", secret_data(docs, "worker-api-key"))
    keys = tmp_path / "api-keys"
    keys.write_text(secret_data(with_tenants, "api-keys"))
    script = helm_test_pod_script()
    with running_gateway([worker.base_url], tmp_path, "--api-key-file", str(keys)) as gateway:
        run = run_test_pod(script, gateway, keys)
        assert run.returncode == 0, run.stdout + run.stderr
        answer = chat(gateway, "sk-search-0001")
        assert answer.headers["x-ratelimit-remaining-requests"] == "48"  # the Pod's, then this
