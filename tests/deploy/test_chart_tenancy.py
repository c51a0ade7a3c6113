"""Tenants in the chart: the Secret's key file in the tenant format as the gateway parses it,
the Redis the gateways share (started by the chart or given), and the values refused."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from service.tenancy.tenants import Limits, parse_key_file
from tests.deploy.chart import find, helm, render, template_args
from tests.deploy.test_gateway_config import gateway_settings

TENANTS = json.dumps(
    [
        {
            "name": "search",
            "keys": ["sk-search-0001"],
            "requests_per_minute": 60,
            "concurrent_requests": 4,
        },
        {"name": "ops", "keys": ["sk-ops-000001"], "admin": True, "tokens_per_minute": None},
    ]
)


def test_tenants_render_a_key_file_the_gateway_reads(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    docs = render(
        sets=("gateway.replicas=1",),
        set_json=(
            f"gateway.apiKeys.tenants={TENANTS}",
            'gateway.apiKeys.tenantDefaults={"tokens_per_minute": 9000}',
        ),
    )
    secret = find(docs, "Secret", "-gateway-api-keys")["data"]
    ring = parse_key_file(base64.b64decode(secret["api-keys"]).decode(), [])
    assert ring.tenancy and [t.name for t in ring.tenants] == ["search", "ops"]
    search = ring.lookup("sk-search-0001")
    assert search is not None and search.limits == Limits(
        requests_per_minute=60, tokens_per_minute=9000, concurrent_requests=4
    )
    ops = ring.lookup("sk-ops-000001")
    assert ops is not None and ops.admin and ops.limits.tokens_per_minute is None
    # Prometheus's bearer token: the first tenant's first key, alone.
    assert base64.b64decode(secret["metrics-token"]).decode() == "sk-search-0001"
    settings = gateway_settings(docs, monkeypatch)
    assert settings.redis_url is None and settings.rate_limit_failure_mode == "open"
    assert not [d for d in docs if d["metadata"]["name"].endswith("-redis")]


def test_the_charts_redis_is_shared_by_the_gateways(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(
        sets=(
            "gateway.rateLimits.redis.deploy=true",
            "gateway.rateLimits.failureMode=closed",
            "gateway.processes=2",
            "networkPolicy.enabled=true",
        ),
        set_json=(f"gateway.apiKeys.tenants={TENANTS}", "gateway.rateLimits.deadlineSeconds=0.25"),
    )
    password = base64.b64decode(find(docs, "Secret", "-redis")["data"]["password"]).decode()
    settings = gateway_settings(docs, monkeypatch)
    assert settings.redis_url == f"redis://:{password}@rel-dflash-serving-redis:6379/0"
    assert settings.rate_limit_failure_mode == "closed"
    assert settings.rate_limit_deadline_s == 0.25
    redis = find(docs, "Deployment", "-redis")["spec"]["template"]["spec"]["containers"][0]
    assert redis["args"][:2] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert find(docs, "Service", "-redis")["spec"]["ports"][0]["port"] == 6379
    policy = find(docs, "NetworkPolicy", "-redis")["spec"]["ingress"][0]["from"][0]
    assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"


def test_an_existing_redis_comes_from_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(
        sets=(
            "gateway.rateLimits.redis.existingSecret=shared-redis",
            "gateway.rateLimits.redis.secretKey=url",
        ),
        set_json=(f"gateway.apiKeys.tenants={TENANTS}",),
    )
    c = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    (redis_env,) = [v for v in c["env"] if v["name"] == "DFLASH_GATEWAY_REDIS_URL"]
    assert redis_env["valueFrom"]["secretKeyRef"] == {"name": "shared-redis", "key": "url"}


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        ((), "need a shared store"),  # 2 gateway replicas by default
        (("gateway.apiKeys.enabled=false", "worker.requireApiKey=false"), "apiKeys.enabled"),
        (("gateway.apiKeys.existingSecret=mine",), "put the tenant file in that Secret"),
        (
            ("gateway.rateLimits.redis.deploy=true", "gateway.rateLimits.redis.existingSecret=x"),
            "not both",
        ),
        (("gateway.rateLimits.redis.deploy=true", "gateway.rateLimits.failureMode=maybe"), "open"),
    ],
)
def test_tenancy_values_that_cannot_work_are_refused(sets: tuple[str, ...], message: str) -> None:
    args = template_args(sets=sets, set_json=(f"gateway.apiKeys.tenants={TENANTS}",))
    done = helm(*args)
    assert done.returncode != 0 and message in done.stderr, done.stderr
