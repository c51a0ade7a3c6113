"""GatewaySettings: env and file keys, comma lists, bounds."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from service.settings import GatewaySettings


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
    assert sorted(settings.load_api_keys()) == ["sk-env", "sk-file"]


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
