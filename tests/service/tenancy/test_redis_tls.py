"""The ledger over TLS (rediss://) and as an ACL user, against real redis-servers listening
with certificates made by `openssl`: the gateway's own settings build the connection
(service.app.ledger). A wrong CA, an expired certificate, a host name that does not match and
a missing client certificate each fail as the mode says (served open, or 503), within the
deadline, with a log line naming the cause."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.app import ledger
from service.metrics import GatewayMetrics
from service.settings import GatewaySettings
from service.tenancy.ledger import Charge, month_of
from service.tenancy.limits import RateLimiter
from service.tenancy.redis_client import RedisUnavailable, ReplyError
from service.tenancy.tenants import Limits, Tenant
from tests.fixtures.redis import RedisServer, ServerTls, running_redis
from tests.fixtures.tls_certs import Certs, make_certs
from wire.errors import Unavailable

pytestmark = pytest.mark.anyio
WHO = Tenant("acme", Limits(requests_per_minute=100, concurrent_requests=3))
# What the ledger needs and nothing more (docs/redis.md): its own keys, its two scripts, and
# the commands they run.
LEDGER_ACL = (
    "on >ledger-pw ~{dflash:* resetchannels -@all +ping +evalsha +script|load +time +get +set "
    "+exists +incr +incrby +expire +pexpire +zadd +zrem +zcard +zremrangebyscore"
)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def server(
    tmp_path_factory: pytest.TempPathFactory, certs: Certs, name: str, auth_clients: str
) -> Iterator[RedisServer]:
    tls = ServerTls(certs.path(f"{name}.crt"), certs.path(f"{name}.key"), certs.ca, auth_clients)
    args = ["--user", "ledger", *LEDGER_ACL.split()]
    with running_redis(tmp_path_factory.mktemp(name), tls=tls, args=args) as running:
        yield running


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[RedisServer]:
    yield from server(tmp_path_factory, certs, "server", "optional")


@pytest.fixture(scope="module")
def mutual(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[RedisServer]:
    yield from server(tmp_path_factory, certs, "server", "yes")


@pytest.fixture(scope="module")
def expired(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[RedisServer]:
    yield from server(tmp_path_factory, certs, "expired", "optional")


@pytest.fixture(scope="module")
def wrong_host(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[RedisServer]:
    yield from server(tmp_path_factory, certs, "wrong-host", "optional")


def settings(redis: RedisServer, **extra: Any) -> GatewaySettings:
    """The ACL user, its password apart from the URL (as from a Secret), the test CA."""
    values: dict[str, Any] = {
        "redis_url": f"rediss://ledger@127.0.0.1:{redis.port}/0",
        "redis_password": "ledger-pw",
        "rate_limit_deadline_s": 2.0,
        **extra,
    }
    return GatewaySettings(**values)


async def test_an_acl_user_over_tls_admits_and_settles(good: RedisServer, certs: Certs) -> None:
    store = ledger(settings(good, redis_tls_ca_file=certs.ca))
    verdict = await store.admit(WHO, "a")
    assert verdict.refused is None and verdict.usage.concurrent == 1
    await store.settle(WHO, "a", Charge(7, month_of(time.time()), verdict.admitted_ms))
    usage = await store.usage(WHO)
    assert (usage.month_requests, usage.month_tokens, usage.concurrent) == (1, 7, 0)
    client = store.client  # type: ignore[attr-defined]
    with pytest.raises(ReplyError, match="NOPERM"):  # the ACL holds: no other key
        await client.call("GET", "someone-else")
    await store.close()
    wrong = ledger(settings(good, redis_tls_ca_file=certs.ca, redis_password="nope"))
    with pytest.raises(RedisUnavailable, match="WRONGPASS"):
        await wrong.usage(WHO)


async def test_mutual_tls_takes_the_client_certificate(mutual: RedisServer, certs: Certs) -> None:
    files = {"redis_tls_cert_file": certs.path("client.crt")}
    files["redis_tls_key_file"] = certs.path("client.key")
    store = ledger(settings(mutual, redis_tls_ca_file=certs.ca, **files))
    assert (await store.admit(WHO, "m")).refused is None
    await store.close()


CASES = {
    # name: (server fixture, settings, the cause the log names)
    "wrong CA": (
        "good",
        {"redis_tls_ca_file": "other-ca.crt"},
        "self-signed certificate in certificate chain",
    ),
    "expired": ("expired", {"redis_tls_ca_file": "ca.crt"}, "certificate has expired"),
    "host name": ("wrong_host", {"redis_tls_ca_file": "ca.crt"}, "IP address mismatch"),
    "no client certificate": (
        "mutual",
        {"redis_tls_ca_file": "ca.crt"},
        "require a client certificate",
    ),
}


@pytest.mark.parametrize("mode", ["open", "closed"])
@pytest.mark.parametrize("case", CASES)
async def test_a_bad_certificate_fails_as_configured_never_hangs_and_says_why(
    case: str,
    mode: str,
    certs: Certs,
    request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fixture, files, cause = CASES[case]
    redis = request.getfixturevalue(fixture)
    paths = {name: certs.path(value) for name, value in files.items()}
    config = settings(redis, rate_limit_deadline_s=0.5, rate_limit_failure_mode=mode, **paths)
    limiter = RateLimiter(ledger(config), GatewayMetrics(), config.rate_limit_failure_mode)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="dflash.gateway.limits"):
        if mode == "open":
            ticket = await limiter.admit(WHO, "m")
            assert ticket.admitted_ms is None and ticket.headers == ()  # served, unlimited
        else:
            with pytest.raises(Unavailable):
                await limiter.admit(WHO, "m")
    assert time.monotonic() - started < 1.0
    assert cause in caplog.text, caplog.text
    await limiter.backlog.flush(0)
    await limiter.ledger.close()


async def test_verification_off_connects_and_warns_at_startup(
    expired: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="dflash.gateway"):
        store = ledger(settings(expired, redis_tls_verify=False))
    assert "Redis TLS verification is OFF" in caplog.text
    assert (await store.admit(WHO, "v")).refused is None
    await store.close()


def test_tls_settings_need_rediss_and_a_cert_needs_its_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="need a rediss:// redis_url"):
        GatewaySettings(redis_url="redis://h", redis_tls_ca_file=tmp_path / "ca.crt")
    with pytest.raises(ValueError, match="go together"):
        GatewaySettings(redis_url="rediss://h", redis_tls_cert_file=tmp_path / "c.crt")
