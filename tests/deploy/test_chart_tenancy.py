"""Tenants in the chart: the Secret's key file in the tenant format as the gateway parses it,
the Redis the gateways share (started by the chart or given), and the values refused."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.tenancy.ledger import Charge, TenantUsage, month_of
from service.tenancy.redis_client import RedisClient, RedisUnavailable, ReplyError
from service.tenancy.redis_ledger import RedisLedger
from service.tenancy.tenants import KeyFileError, Limits, Tenant, parse_key_file
from tests.deploy.chart import find, helm, render, template_args
from tests.deploy.test_gateway_config import gateway_settings
from tests.fixtures.redis import running_redis

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
    assert settings.redis_url == "redis://rel-dflash-serving-redis:6379/0"
    assert settings.redis_password == password
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
            "one of deploy, existingSecret or url",
        ),
        (
            (
                "gateway.rateLimits.redis.url=rediss://h",
                "gateway.rateLimits.redis.existingSecret=x",
            ),
            "one of deploy, existingSecret or url",
        ),
        (
            ("gateway.rateLimits.redis.deploy=true", "gateway.rateLimits.redis.tls.enabled=true"),
            "needs deploy=true and tls.secret",
        ),
        (
            (
                "gateway.rateLimits.redis.url=rediss://h",
                "gateway.rateLimits.redis.tls.enabled=true",
            ),
            "needs deploy=true and tls.secret",
        ),
        (
            (
                "gateway.rateLimits.redis.url=rediss://h",
                "gateway.rateLimits.redis.tls.clientCertificate=true",
            ),
            "clientCertificate needs tls.secret",
        ),
        (
            ("gateway.rateLimits.redis.deploy=true", "gateway.rateLimits.redis.passwordSecret=p"),
            "generated password",
        ),
        (("gateway.rateLimits.redis.url=redis:/h",), "url"),
        (("gateway.rateLimits.redis.deploy=true", "gateway.rateLimits.failureMode=maybe"), "open"),
    ],
)
def test_tenancy_values_that_cannot_work_are_refused(sets: tuple[str, ...], message: str) -> None:
    args = template_args(sets=sets, set_json=(f"gateway.apiKeys.tenants={TENANTS}",))
    done = helm(*args)
    assert done.returncode != 0 and message in done.stderr, done.stderr


def redis_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec = find(docs, "Deployment", "-redis")["spec"]["template"]["spec"]
    return spec["containers"][0]  # type: ignore[no-any-return]


def test_the_charts_redis_persists_and_never_evicts() -> None:
    docs = render(
        sets=("gateway.rateLimits.redis.deploy=true", "gateway.rateLimits.redis.maxmemory=64mb"),
        set_json=(f"gateway.apiKeys.tenants={TENANTS}",),
    )
    args = redis_container(docs)["args"]
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert flags["--appendonly"] == "yes" and flags["--appendfsync"] == "everysec"
    assert flags["--maxmemory-policy"] == "noeviction" and flags["--maxmemory"] == "64mb"
    assert flags["--dir"] == "/data" and flags["--save"] == ""
    claim = find(docs, "PersistentVolumeClaim", "-redis-data")["spec"]
    assert claim["resources"]["requests"]["storage"] == "1Gi"
    volumes = find(docs, "Deployment", "-redis")["spec"]["template"]["spec"]["volumes"]
    assert volumes[0]["persistentVolumeClaim"]["claimName"].endswith("-redis-data")
    off = render(
        sets=(
            "gateway.rateLimits.redis.deploy=true",
            "gateway.rateLimits.redis.persistence.enabled=false",
        ),
        set_json=(f"gateway.apiKeys.tenants={TENANTS}",),
    )
    assert not [d for d in off if d["kind"] == "PersistentVolumeClaim"]


def test_the_charts_redis_with_tls_and_the_gateway_checking_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs = render(
        sets=(
            "gateway.rateLimits.redis.deploy=true",
            "gateway.rateLimits.redis.tls.enabled=true",
            "gateway.rateLimits.redis.tls.secret=redis-certs",
            "gateway.rateLimits.redis.tls.clientCertificate=true",
        ),
        set_json=(f"gateway.apiKeys.tenants={TENANTS}",),
    )
    args = redis_container(docs)["args"]
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert (flags["--port"], flags["--tls-port"], flags["--tls-auth-clients"]) == (
        "0",
        "6379",
        "yes",
    )
    settings = gateway_settings(docs, monkeypatch)
    assert settings.redis_url == "rediss://rel-dflash-serving-redis:6379/0"
    assert str(settings.redis_tls_ca_file) == "/etc/dflash/redis-tls/ca.crt"
    assert str(settings.redis_tls_cert_file) == "/etc/dflash/redis-tls/tls.crt"
    assert settings.redis_tls_verify
    pod = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "redis-tls"]
    assert volume["secret"]["secretName"] == "redis-certs"


def test_a_managed_redis_by_url_with_its_password_and_ca_from_secrets() -> None:
    docs = render(
        sets=(
            "gateway.rateLimits.redis.url=rediss://ledger@cache.example:6380/0",
            "gateway.rateLimits.redis.passwordSecret=cache-auth",
            "gateway.rateLimits.redis.tls.secret=cache-ca",
        ),
        set_json=(f"gateway.apiKeys.tenants={TENANTS}",),
    )
    c = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    env = {v["name"]: v.get("value", v.get("valueFrom")) for v in c["env"]}
    assert env["DFLASH_GATEWAY_REDIS_URL"] == "rediss://ledger@cache.example:6380/0"
    assert env["DFLASH_GATEWAY_REDIS_PASSWORD"] == {
        "secretKeyRef": {"name": "cache-auth", "key": "password"}
    }
    assert env["DFLASH_GATEWAY_REDIS_TLS_CA_FILE"] == "/etc/dflash/redis-tls/ca.crt"
    assert "DFLASH_GATEWAY_REDIS_TLS_CERT_FILE" not in env
    assert not [d for d in docs if d["metadata"]["name"].endswith("-redis")]


@pytest.mark.anyio
async def test_the_month_survives_a_kill_of_the_charts_redis_as_rendered(tmp_path: Path) -> None:
    """redis-server with the flags the chart renders, SIGKILLed mid-month and started again on
    the same directory (the claim): the month's totals are back."""
    docs = render(
        sets=("gateway.rateLimits.redis.deploy=true",),
        set_json=(f"gateway.apiKeys.tenants={TENANTS}",),
    )
    args = [str(tmp_path) if a == "/data" else a for a in redis_container(docs)["args"]]
    args = [a.replace("$(REDIS_PASSWORD)", "pw") for a in args]
    with running_redis(tmp_path, password="pw", args=args) as redis:
        store = RedisLedger(RedisClient(redis.url, deadline_s=2.0), window_s=3600, lease_s=60)
        who = Tenant("search", Limits(tokens_per_month=10**6))
        for lease in ("a", "b", "c"):
            verdict = await store.admit(who, lease)
            await store.settle(who, lease, Charge(7, month_of(time.time()), verdict.admitted_ms))
        redis.kill()  # SIGKILL: no shutdown, no final write
        redis.start()
        usage = await usage_once_loaded(store, who)
        assert (usage.month_requests, usage.month_tokens, usage.concurrent) == (3, 21, 0)
        await store.close()


async def usage_once_loaded(store: RedisLedger, who: Tenant) -> TenantUsage:
    """Redis answers LOADING while it replays its file; the client retries a failed moment."""
    for _ in range(50):
        try:
            return await store.usage(who)
        except (RedisUnavailable, ReplyError):
            await asyncio.sleep(0.1)
    raise AssertionError("Redis never came back")


@pytest.mark.parametrize(
    ("tenants", "message"),
    [
        (
            [{"name": "a", "keys": ["sk-aaaa-0001"]}, {"name": "a", "keys": ["sk-aaaa-0002"]}],
            "duplicate tenant name a",
        ),
        (
            [{"name": "a", "keys": ["sk-aaaa-0001"]}, {"name": "b", "keys": ["sk-aaaa-0001"]}],
            "a key of tenant b is given twice",
        ),
        ([{"name": "a", "keys": ["sk-aaaa-0001", "sk-aaaa-0001"]}], "a key of tenant a"),
    ],
)
def test_tenants_the_gateway_would_refuse_are_refused_at_template_time(
    tenants: list[dict[str, Any]], message: str
) -> None:
    """Else a rollout's new gateway pods crash-loop on the key file (a user's review)."""
    args = template_args(
        sets=("gateway.rateLimits.redis.deploy=true",),
        set_json=(f"gateway.apiKeys.tenants={json.dumps(tenants)}",),
    )
    done = helm(*args)
    assert done.returncode != 0 and message in done.stderr, done.stderr
    assert "sk-aaaa" not in done.stderr  # never a key's value
    with pytest.raises(KeyFileError):  # the gateway's own verdict on the same tenants
        parse_key_file(yaml.safe_dump({"tenants": tenants}), [])
