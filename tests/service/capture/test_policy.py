"""Who is captured: the tenant's share times the pool's, sampled per request."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import TypeAdapter, ValidationError

from service.capture.policy import Capture, CaptureShare
from service.capture.writer import CaptureConfig, CaptureWriter
from service.tenancy.tenants import parse_key_file


def capture(tmp_path: Path, draws: list[float]) -> Capture:
    writer = CaptureWriter(CaptureConfig(uri=str(tmp_path)), lambda outcome, count: None)
    return Capture(writer, {"base": 1.0, "canary": 0.5, "off": 0.0}, draw=lambda: draws.pop(0))


def test_the_tenant_share_times_the_pool_share(tmp_path: Path) -> None:
    policy = capture(tmp_path, [0.3, 0.3, 0.6, 0.1])
    assert policy.wants(1.0, "base")  # 1.0: no draw
    assert policy.wants(1.0, "canary")  # 0.3 < 0.5
    assert not policy.wants(0.5, "canary")  # 0.3 >= 0.25
    assert not policy.wants(1.0, "off") and not policy.wants(0.0, "base")  # 0: no draw
    assert not policy.wants(0.2, "found-by-dns")  # an unnamed pool counts 1.0: 0.6 >= 0.2
    assert policy.wants(0.2, "found-by-dns")  # 0.1 < 0.2


@pytest.mark.parametrize("value, share", [(True, 1.0), (False, 0.0), (0.25, 0.25), (1, 1.0)])
def test_a_share_is_a_boolean_or_a_fraction(value: object, share: float) -> None:
    assert TypeAdapter(CaptureShare).validate_python(value) == share


@pytest.mark.parametrize("value", [1.01, -0.5, "always", None])
def test_anything_else_is_refused(value: object) -> None:
    with pytest.raises(ValidationError):
        TypeAdapter(CaptureShare).validate_python(value)


def test_tenants_opt_in_and_plain_keys_capture_everything() -> None:
    ring = parse_key_file(
        "tenants:\n  - {name: a, keys: [k1], capture: 0.1}\n  - {name: b, keys: [k2]}\n", []
    )
    assert [(t.name, t.capture) for t in ring.tenants] == [("a", 0.1), ("b", 0.0)]
    plain = parse_key_file("k1\nk2\n", [])
    assert {t.capture for t in plain.tenants} == {1.0}
    with pytest.raises(ValueError, match="capture"):
        parse_key_file("tenants:\n  - {name: a, keys: [k1], capture: 2}\n", [])
