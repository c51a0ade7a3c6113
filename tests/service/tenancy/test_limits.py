"""OpenAI's shapes: reset durations, x-ratelimit-* headers, 429 bodies; and what the limiter does
when its store fails (open: served and counted; closed: 503 with Retry-After)."""

from __future__ import annotations

import pytest

from service.metrics import GatewayMetrics
from service.reports import Usage
from service.tenancy.ledger import Charge, TenantUsage, Verdict
from service.tenancy.limits import (
    RateLimited,
    RateLimiter,
    Ticket,
    duration,
    rate_headers,
    refused_error,
)
from service.tenancy.redis_client import RedisUnavailable
from service.tenancy.tenants import Limits, Tenant
from wire.errors import Unavailable

pytestmark = pytest.mark.anyio


def usage(requests: int = 0, tokens: int = 0, reset_s: float = 30.0) -> TenantUsage:
    return TenantUsage(requests, tokens, requests, tokens, 0, reset_s, "2026-11")


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0ms"),
        (0.0174, "18ms"),
        (1.0, "1s"),
        (8.64, "8.64s"),
        (59.9995, "1m0s"),
        (60.0, "1m0s"),
        (360.0, "6m0s"),
        (61.25, "1m1.25s"),
        (3723.5, "1h2m3.5s"),
    ],
)
def test_reset_durations_are_written_as_openai_writes_them(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_headers_name_each_limit_the_tenant_has() -> None:
    limits = Limits(requests_per_minute=60, tokens_per_minute=1000)
    headers = dict(rate_headers(limits, usage(requests=3, tokens=1200, reset_s=12.5)))
    assert headers == {
        b"x-ratelimit-limit-requests": b"60",
        b"x-ratelimit-remaining-requests": b"57",
        b"x-ratelimit-reset-requests": b"12.5s",
        b"x-ratelimit-limit-tokens": b"1000",
        b"x-ratelimit-remaining-tokens": b"0",  # over by in-flight requests: never negative
        b"x-ratelimit-reset-tokens": b"12.5s",
    }
    assert rate_headers(Limits(concurrent_requests=3), usage()) == ()


def test_429_bodies_say_which_limit_and_when_to_retry() -> None:
    who = Tenant("search", Limits(requests_per_minute=3, concurrent_requests=2))
    error = refused_error(who, "requests", usage(requests=3, reset_s=20.2))
    body = error.body()["error"]
    assert error.status_code == 429 and body["code"] == "rate_limit_exceeded"
    assert body["type"] == "requests"
    assert body["message"] == (
        "Rate limit reached for tenant search on requests per min (RPM): Limit 3, Used 3. "
        "Please try again in 20.2s."
    )
    assert error.headers["Retry-After"] == "21" and error.headers["retry-after-ms"] == "20200"
    assert error.headers["x-ratelimit-remaining-requests"] == "0"
    busy = refused_error(who, "concurrency", usage())
    assert busy.headers["Retry-After"] == "1" and "concurrent requests: Limit 2" in busy.message
    quota = refused_error(Tenant("q", Limits(tokens_per_month=9)), "quota", usage(tokens=9))
    assert quota.body()["error"]["code"] == "insufficient_quota"
    assert quota.body()["error"]["type"] == "insufficient_quota"
    assert int(quota.headers["Retry-After"]) > 0


class BrokenLedger:
    def __init__(self) -> None:
        self.settled = 0

    async def admit(self, tenant: Tenant, lease: str) -> Verdict:
        raise RedisUnavailable("down")

    async def settle(self, tenant: Tenant, lease: str, charge: Charge) -> None:
        self.settled += 1
        raise RedisUnavailable("down")

    async def usage(self, tenant: Tenant) -> TenantUsage:
        raise RedisUnavailable("down")

    async def close(self) -> None:
        return None


async def test_a_failed_store_serves_in_open_mode_and_refuses_in_closed_mode(
    caplog: pytest.LogCaptureFixture,
) -> None:
    who = Tenant("t", Limits(requests_per_minute=1))
    metrics = GatewayMetrics()
    open_limiter = RateLimiter(BrokenLedger(), metrics, "open")
    for _ in range(2):  # served without limits, counted once the store answers
        ticket = await open_limiter.admit(who, "m")
        assert ticket.headers == () and ticket.admitted_ms is None
    assert await open_limiter.usage(who) is None
    closed = RateLimiter(BrokenLedger(), metrics, "closed")
    with pytest.raises(Unavailable) as caught:
        await closed.admit(who, "m")
    assert caught.value.status_code == 503 and caught.value.headers["Retry-After"] == "1"
    assert caught.value.code == "rate_limit_store_unavailable"
    text = metrics.render()[0].decode()
    assert 'dflash_rate_limit_store_errors_total{operation="admit",outcome="served"} 2.0' in text
    assert 'dflash_rate_limit_store_errors_total{operation="admit",outcome="refused"} 1.0' in text
    assert caplog.text.count("rate-limit store failed") == 2  # once per limiter, not per call


async def test_a_ticket_settles_once() -> None:
    ledger = BrokenLedger()
    limiter = RateLimiter(ledger, GatewayMetrics(), "open")

    ticket = Ticket(limiter, Tenant("t", Limits()), "l", (), 1)
    await ticket.settle(Usage(3, 4))
    ticket.release()  # already settled: nothing more
    await ticket.settle(None)
    assert ledger.settled == 1
    assert len(limiter.backlog) == 1  # the store failed it: queued to be retried
    await limiter.backlog.flush(0.05)  # the store never answers: lost, and counted
    text = limiter.metrics.render()[0].decode()
    assert 'dflash_rate_limit_ledger_lost_total{reason="shutdown"} 1.0' in text
    assert isinstance(refused_error(Tenant("t", Limits()), "tokens", usage()), RateLimited)
