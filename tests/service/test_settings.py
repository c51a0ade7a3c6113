"""GatewaySettings: env and file keys, comma lists, bounds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from service.settings import GatewaySettings
from tests.fixtures.keys import keys_of


def test_env_lists_and_keys_from_env_and_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# rotated weekly\nsk-file\n\n", encoding="utf-8")
    monkeypatch.setenv("DFLASH_GATEWAY_WORKERS", "http://a:1, http://b:2")
    monkeypatch.setenv("DFLASH_GATEWAY_API_KEYS", "sk-env")
    monkeypatch.setenv("DFLASH_GATEWAY_API_KEY_FILE", str(keys))
    settings = GatewaySettings()
    assert settings.workers == ["http://a:1", "http://b:2"]
    ring = settings.load_key_ring()
    assert keys_of(ring, ["sk-env", "sk-file", "sk-other"]) == ["sk-env", "sk-file"]


def test_keys_are_not_in_the_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_GATEWAY_API_KEYS", "sk-secret")
    assert "sk-secret" not in repr(GatewaySettings())


@pytest.mark.parametrize(
    ("field", "value"),
    [("port", 70000), ("max_retries", -1), ("routing", "random"), ("unknown", 1)],
)
def test_bad_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValidationError):
        GatewaySettings(**{field: value})  # type: ignore[arg-type]


def test_an_empty_capture_uri_is_capture_off_and_a_foreign_scheme_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An empty variable (a template's `CAPTURE_URI: ""`) is capture off, as docs/gateway.md
    says unset is: it was a dataset in the working directory. A scheme no dataset lives in
    (ftp://) is refused naming capture_uri."""
    monkeypatch.setenv("DFLASH_GATEWAY_CAPTURE_URI", "")
    assert GatewaySettings().capture_uri is None and GatewaySettings().capture_config() is None
    assert GatewaySettings(capture_uri="  ").capture_uri is None
    for uri in ("/var/lib/capture", "file:///tmp/x", "s3://b/p", "gs://b/p", "GS://b/p"):
        assert GatewaySettings(capture_uri=uri).capture_uri == uri
    with pytest.raises(ValidationError, match=r"capture_uri\n.*unsupported scheme ftp://"):
        GatewaySettings(capture_uri="ftp://x/y")


def test_single_loggers_levels_come_as_name_equals_level(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_GATEWAY_LOG_LEVELS", "dflash.gateway.fastest=DEBUG, uvicorn=warning")
    assert GatewaySettings().log_levels == {"dflash.gateway.fastest": "debug", "uvicorn": "warning"}
    for bad in ("dflash.gateway.fastest", "=debug", "dflash.gateway.fastest=loud"):
        with pytest.raises(ValidationError, match="log_levels"):
            GatewaySettings(log_levels=bad)


POOL = {"name": "a", "model": "m", "workers": ["http://w:1"]}


@pytest.mark.parametrize(
    ("pools", "named"),
    [
        ([POOL, {**POOL, "workers": ["http://w:2"]}], "duplicate pool names: a"),
        ([{**POOL, "weight": 0}, {**POOL, "name": "b", "weight": 0, "workers": []}], "workers"),
        (
            [{**POOL, "weight": 0}, {**POOL, "name": "b", "weight": 0, "workers": ["http://w:2"]}],
            "every pool of model m has weight 0",
        ),
        ([POOL, {**POOL, "name": "b"}], "worker http://w:1 is in pools 'a' and 'b'"),
        ([POOL, {"name": "b", "workers": ["http://w:2"]}], "each needs a model: b"),
        ([{**POOL, "name": "Bad_Name"}], "pools.0.name"),
        ([{**POOL, "weight": -1}], "pools.0.weight"),
        ([{**POOL, "engine": "tgi"}], "pools.0.engine"),
    ],
)
def test_bad_pools_are_refused_naming_the_value(pools: list[Any], named: str) -> None:
    with pytest.raises(ValidationError) as caught:
        GatewaySettings(pools=pools)
    where = [".".join(map(str, e["loc"])) + ": " + e["msg"] for e in caught.value.errors()]
    assert any(named in line for line in where), where


def test_pools_come_as_json_in_env_and_exclude_plain_workers(monkeypatch: Any) -> None:
    monkeypatch.setenv("DFLASH_GATEWAY_POOLS", json.dumps([POOL]))
    (spec,) = GatewaySettings().pool_specs()
    assert (spec.name, spec.model, spec.weight, spec.workers) == ("a", "m", 100, ["http://w:1"])
    with pytest.raises(ValidationError, match="not both"):
        GatewaySettings(workers=["http://w:9"])
    monkeypatch.delenv("DFLASH_GATEWAY_POOLS")
    (legacy,) = GatewaySettings(worker_dns="w:8000").pool_specs()
    assert (legacy.name, legacy.model, legacy.worker_dns) == ("default", None, "w:8000")
