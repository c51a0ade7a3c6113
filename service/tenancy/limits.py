"""Enforcing tenants' limits as OpenAI does: a 429 with OpenAI's error body and Retry-After when
a limit is reached, and `x-ratelimit-*` headers on every response of a tenant with limits.

The ledger (tenancy/ledger.py) keeps the counts; this module turns its verdict into headers or
an error, and decides what happens when the ledger's store does not answer in time: serve anyway
(`open`, the default: logged and counted, and the request is counted in the ledger once the
store answers again) or refuse with a 503 and Retry-After (`closed`). A settlement the store
does not take in time is retried from a bounded queue (service.tenancy.ledger_backlog).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
import time
from typing import Literal

from service.metrics import GatewayMetrics
from service.reports import Usage
from service.tenancy.ledger import (
    Charge,
    Ledger,
    Refusal,
    TenantUsage,
    month_of,
    seconds_to_next_month,
)
from service.tenancy.ledger_backlog import Backlog
from service.tenancy.redis_client import RedisUnavailable, ReplyError
from service.tenancy.tenants import Limits, Tenant
from wire.errors import ApiError, Unavailable

log = logging.getLogger("dflash.gateway.limits")
FailureMode = Literal["open", "closed"]
STORE_ERRORS = (RedisUnavailable, ReplyError, OSError)
WARN_EVERY_S = 10.0  # a store that is down is logged once per interval, not per request
FLUSH_S = 5.0  # at shutdown, how long settlements still queued wait for the store
Headers = tuple[tuple[bytes, bytes], ...]


class RateLimited(ApiError):
    """OpenAI's 429: `rate_limit_exceeded` with the limit's kind as the type, or
    `insufficient_quota` when the month's token quota is spent."""

    status_code = 429
    error_type = "requests"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, error_type: str, code: str, headers: dict[str, str]):
        super().__init__(message, code=code, headers=headers)
        self.error_type = error_type


def duration(seconds: float) -> str:
    """A reset time as OpenAI writes it (Go's duration format): 20ms, 1.5s, 6m0s, 1h2m3s."""
    ms = max(0, math.ceil(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms"
    secs, millis = divmod(ms, 1000)
    minutes, secs = divmod(secs, 60)
    text = f"{secs}.{millis:03d}".rstrip("0") + "s" if millis else f"{secs}s"
    if minutes >= 60:
        return f"{minutes // 60}h{minutes % 60}m{text}"
    return f"{minutes}m{text}" if minutes else text


def rate_headers(limits: Limits, usage: TenantUsage) -> Headers:
    """x-ratelimit-{limit,remaining,reset}-{requests,tokens} for the limits the tenant has."""
    rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
    if rpm is None and tpm is None:
        return ()
    reset = duration(usage.reset_s).encode()
    headers: Headers = ()
    if rpm is not None:
        headers = (
            (b"x-ratelimit-limit-requests", b"%d" % rpm),
            (b"x-ratelimit-remaining-requests", b"%d" % max(0, rpm - usage.requests)),
            (b"x-ratelimit-reset-requests", reset),
        )
    if tpm is not None:
        headers += (
            (b"x-ratelimit-limit-tokens", b"%d" % tpm),
            (b"x-ratelimit-remaining-tokens", b"%d" % max(0, tpm - usage.tokens)),
            (b"x-ratelimit-reset-tokens", reset),
        )
    return headers


def refused_error(tenant: Tenant, refused: Refusal, usage: TenantUsage) -> RateLimited:
    """The 429, worded as OpenAI words its own, with how long to wait. Retry-After is whole
    seconds (the OpenAI SDK also reads retry-after-ms, to the millisecond)."""
    limits = tenant.limits
    wait_s = usage.reset_s
    if refused == "requests":
        what = f"requests per min (RPM): Limit {limits.requests_per_minute}, Used {usage.requests}"
    elif refused == "tokens":
        what = f"tokens per min (TPM): Limit {limits.tokens_per_minute}, Used {usage.tokens}"
    elif refused == "concurrency":
        cap = limits.concurrent_requests
        what = f"concurrent requests: Limit {cap}, In flight {usage.concurrent}"
        wait_s = 1.0  # a request ends any moment; no window to wait for
    else:
        wait_s = seconds_to_next_month(time.time())
        message = (
            f"You exceeded your monthly token quota for tenant {tenant.name}: Limit "
            f"{limits.tokens_per_month}, Used {usage.month_tokens} in {usage.month}."
        )
        return RateLimited(
            message,
            error_type="insufficient_quota",
            code="insufficient_quota",
            headers=retry_headers(wait_s, limits, usage),
        )
    message = (
        f"Rate limit reached for tenant {tenant.name} on {what}. "
        f"Please try again in {duration(wait_s)}."
    )
    error_type = "tokens" if refused == "tokens" else "requests"
    return RateLimited(
        message,
        error_type=error_type,
        code="rate_limit_exceeded",
        headers=retry_headers(wait_s, limits, usage),
    )


def retry_headers(wait_s: float, limits: Limits, usage: TenantUsage) -> dict[str, str]:
    headers = {name.decode(): value.decode() for name, value in rate_headers(limits, usage)}
    headers["Retry-After"] = str(max(1, math.ceil(wait_s)))
    headers["retry-after-ms"] = str(max(1, math.ceil(wait_s * 1000)))
    return headers


class Ticket:
    """An admitted request's place in the ledger: its headers, and the settlement (tokens
    charged, lease given back) that must happen exactly once when it ends. `admitted_ms` is
    None for a request served while the store did not answer: its settlement counts it."""

    def __init__(
        self,
        limiter: RateLimiter,
        tenant: Tenant,
        lease: str,
        headers: Headers,
        admitted_ms: int | None,
    ) -> None:
        self.limiter, self.tenant, self.lease, self.headers = limiter, tenant, lease, headers
        self.admitted_ms = admitted_ms
        self.settled = False

    def charge(self, tokens: int) -> Charge:
        return Charge(tokens, month_of(time.time()), self.admitted_ms)

    async def settle(self, usage: Usage | None) -> None:
        """Charge the worker's reported usage; before the response's last bytes go out, so
        a client's next request already sees it."""
        if self.settled:
            return
        self.settled = True
        tokens = usage.prompt_tokens + usage.completion_tokens if usage is not None else 0
        await self.limiter.settle(self.tenant, self.lease, self.charge(tokens))

    def release(self) -> None:
        """The request ended without a settlement (client gone, upstream failure): give the
        lease back, charging nothing. Synchronous: it runs while a task is being cancelled."""
        if self.settled:
            return
        self.settled = True
        self.limiter.settle_later(self.tenant, self.lease, self.charge(0))


class RateLimiter:
    def __init__(
        self,
        ledger: Ledger,
        metrics: GatewayMetrics,
        failure_mode: FailureMode,
        backlog: int = 100_000,
    ) -> None:
        self.ledger, self.metrics, self.failure_mode = ledger, metrics, failure_mode
        self.backlog = Backlog(ledger, metrics, backlog)
        self._warned_at = -math.inf
        self._lease_prefix, self._leases = secrets.token_hex(6) + "-", itertools.count()
        self._background: set[asyncio.Task[None]] = set()

    async def admit(self, tenant: Tenant, model: str) -> Ticket:
        """A ticket for an admitted request; raises RateLimited over a limit. When the store
        failed and the mode is open, a ticket without headers: the request is served, and
        counted when its settlement reaches the store."""
        # Unique across processes and replicas: a random prefix per limiter, then a count.
        lease = f"{self._lease_prefix}{next(self._leases)}"
        try:
            verdict = await self.ledger.admit(tenant, lease)
        except STORE_ERRORS as exc:
            self._store_failed("admit", exc)
            if self.failure_mode == "closed":
                raise Unavailable(
                    "Rate limits cannot be checked right now; retry the request.",
                    code="rate_limit_store_unavailable",
                ) from None
            return Ticket(self, tenant, lease, (), None)
        if verdict.refused is not None:
            self.metrics.count_rate_limited(tenant.name, model, verdict.refused)
            raise refused_error(tenant, verdict.refused, verdict.usage)
        headers = rate_headers(tenant.limits, verdict.usage)
        return Ticket(self, tenant, lease, headers, verdict.admitted_ms)

    async def settle(self, tenant: Tenant, lease: str, charge: Charge) -> None:
        """One try now; a miss is queued and retried until it lands."""
        try:
            await self.ledger.settle(tenant, lease, charge)
        except STORE_ERRORS as exc:
            self._store_failed("settle", exc)
            self.backlog.put(tenant, lease, charge)

    async def usage(self, tenant: Tenant) -> TenantUsage | None:
        """The tenant's counts, or None when the store does not answer."""
        try:
            return await self.ledger.usage(tenant)
        except STORE_ERRORS as exc:
            self._store_failed("usage", exc)
            return None

    def settle_later(self, tenant: Tenant, lease: str, charge: Charge) -> None:
        task = asyncio.get_running_loop().create_task(self.settle(tenant, lease, charge))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _store_failed(self, operation: str, exc: BaseException) -> None:
        outcome = "refused" if self.failure_mode == "closed" and operation == "admit" else "served"
        self.metrics.count_store_error(operation, outcome)
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning(
                "rate-limit store failed (%s: %s); mode %s: requests are %s until it answers",
                operation,
                exc,
                self.failure_mode,
                "refused with 503" if self.failure_mode == "closed" else "served without limits",
            )

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(set(self._background), timeout=1.0)
        await self.backlog.flush(FLUSH_S)
        await self.ledger.close()
