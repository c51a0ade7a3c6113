"""API-key auth in front of a real worker: keys from env or a file, open probes."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from service.settings import GatewaySettings
from service.tenancy.auth import ApiKeyAuth, KeyFileWatcher
from service.tenancy.tenants import KeyRing
from tests.fixtures.worker import WorkerHandle, running_worker
from tests.service.conftest import MODEL, running_gateway, wait_until, worker_args

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_keys_from_env_and_file(
    worker: WorkerHandle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# one key per line\nfile-key\n")
    monkeypatch.setenv("DFLASH_GATEWAY_API_KEYS", "env-key-1, env-key-2")
    with running_gateway(workers=[worker.base_url], api_key_file=key_file) as gw:
        for key in ("env-key-2", "file-key"):
            sdk = openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0)
            assert sdk.chat.completions.create(
                model=MODEL, messages=CHAT["messages"], max_tokens=2
            ).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=gw.v1, api_key="wrong", max_retries=0).models.list()
        missing = httpx.post(gw.v1 + "/chat/completions", json=CHAT)
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "invalid_api_key"
        assert missing.headers["www-authenticate"] == "Bearer"
        assert missing.headers["x-request-id"]
        basic = httpx.get(gw.v1 + "/models", headers={"Authorization": "Basic env-key-1"})
        assert basic.status_code == 401
        assert httpx.get(gw.base_url + "/health").status_code == 200
        assert httpx.get(gw.base_url + "/ready").status_code == 200
        assert httpx.get(gw.base_url + "/metrics").status_code == 200  # open by default


def test_metrics_auth_is_configurable(worker: WorkerHandle) -> None:
    with running_gateway(workers=[worker.base_url], api_keys=["k"], metrics_auth=True) as gw:
        assert httpx.get(gw.base_url + "/metrics").status_code == 401
        ok = httpx.get(gw.base_url + "/metrics", headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200 and "dflash_requests_in_flight" in ok.text


def test_no_key_disables_auth_and_says_so(
    worker: WorkerHandle, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING), running_gateway(workers=[worker.base_url]) as gw:
        assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30).status_code == 200
    assert "auth is DISABLED" in caplog.text


def test_bearer_check() -> None:
    auth = ApiKeyAuth(["a", "bb"], protect_metrics=False)
    assert auth.allows("Bearer bb") and auth.allows("bearer a")
    assert not auth.allows("Bearer b") and not auth.allows("Bearer ") and not auth.allows(None)
    assert not auth.protects("/health") and not auth.protects("/metrics")
    assert auth.protects("/v1/models")
    assert not ApiKeyAuth([], protect_metrics=True).protects("/v1/models")


def test_gateway_authenticates_to_workers_with_api_keys(tiny_checkpoint: Any) -> None:
    with running_worker(*worker_args(tiny_checkpoint, "--api-key", "inner")) as guarded:
        with running_gateway(workers=[guarded.base_url], worker_api_key="inner") as gw:
            assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30).status_code == 200
            assert [m["id"] for m in httpx.get(gw.v1 + "/models").json()["data"]] == [MODEL]
        with running_gateway(workers=[guarded.base_url]) as gw:  # no key: the worker says 401
            assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30).status_code == 401


def test_a_rotated_key_file_takes_effect_without_a_restart(tmp_path: Path) -> None:
    """Unit: the watcher swaps keys when the file changes; a broken or empty file keeps
    the keys in force (auth never silently turns off)."""
    key_file = tmp_path / "keys"
    key_file.write_text("sk-old\n")
    auth = ApiKeyAuth(["sk-old"], protect_metrics=False)
    settings = GatewaySettings(api_key_file=key_file)
    watcher = KeyFileWatcher(key_file, settings.load_key_ring, auth)
    assert not watcher.check()  # unchanged
    key_file.write_text("# rotated\nsk-new\nsk-newer\n")
    assert watcher.check()
    assert auth.allows("Bearer sk-new") and not auth.allows("Bearer sk-old")
    key_file.write_text("")
    assert not watcher.check() and auth.allows("Bearer sk-new")  # empty: keys stay
    key_file.unlink()
    assert not watcher.check() and auth.allows("Bearer sk-newer")  # gone: keys stay


def test_the_gateway_reloads_its_key_file(worker: WorkerHandle, tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("sk-one\n")
    with running_gateway(
        workers=[worker.base_url], api_key_file=key_file, key_reload_interval_s=0.1
    ) as gw:
        models = gw.v1 + "/models"
        assert httpx.get(models, headers={"Authorization": "Bearer sk-one"}).status_code == 200
        key_file.write_text("sk-two\n")
        wait_until(
            lambda: httpx.get(models, headers={"Authorization": "Bearer sk-two"}).status_code == 200
        )
        assert httpx.get(models, headers={"Authorization": "Bearer sk-one"}).status_code == 401


def test_a_tenant_file_reloads_limits_and_a_broken_one_keeps_the_last_good(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key_file = tmp_path / "keys.yaml"
    key_file.write_text("tenants:\n  - {name: a, keys: [sk-a], requests_per_minute: 5}\n")
    settings = GatewaySettings(api_key_file=key_file)
    auth = ApiKeyAuth(settings.load_key_ring(), protect_metrics=False)
    seen: list[KeyRing] = []
    watcher = KeyFileWatcher(key_file, settings.load_key_ring, auth, on_reload=seen.append)
    key_file.write_text("tenants:\n  - {name: a, keys: [sk-a], requests_per_minute: 9}\n")
    assert watcher.check() and len(seen) == 1
    tenant = auth.tenant_of("Bearer sk-a")
    assert tenant is not None and tenant.limits.requests_per_minute == 9
    key_file.write_text("tenants:\n  - {name: a, keys: [sk-a], requests_per_minute: -1}\n")
    with caplog.at_level(logging.WARNING):
        assert not watcher.check()
    assert "tenants.'a'.requests_per_minute" in caplog.text and "previous keys stay" in caplog.text
    tenant = auth.tenant_of("Bearer sk-a")
    assert tenant is not None and tenant.limits.requests_per_minute == 9 and len(seen) == 1
