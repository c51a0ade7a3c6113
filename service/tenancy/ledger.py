"""The usage ledger: per tenant, what the current windows and month have used, and the one rule
that admits a request or names the limit it would break. Two stores keep it: in this process
(`MemoryLedger`, the default) and in Redis (`service.tenancy.redis_ledger`, shared by every gateway
process and replica). Both apply the same rule, and the same tests run against both.

Windows are fixed: a minute (`window_s`) starts at a multiple of its length on the store's
clock, so every replica agrees where it ends, and a store that restarts loses at most the
window under way. A request is admitted while, in the current window, fewer requests than the
limit were admitted and fewer tokens than the limit were charged, the month's tokens are under
the quota, and fewer requests than the cap are in flight. Tokens are charged when the worker
has reported them (at the end of the request, streams included), so requests in flight when a
window reaches its token limit still finish: a window can end above its token limit by what
those requests generate, at most the concurrency cap times their `max_tokens`.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from service.tenancy.tenants import Limits, Tenant

Refusal = Literal["requests", "tokens", "quota", "concurrency"]


@dataclass(slots=True)
class TenantUsage:
    """A tenant's use of the current window and month (`requests` and `tokens` of the window
    include the request just admitted)."""

    requests: int
    tokens: int
    month_requests: int
    month_tokens: int
    concurrent: int
    reset_s: float  # until the current window ends
    month: str  # "2026-11": the calendar month (UTC) the month totals are for


@dataclass(slots=True)
class Verdict:
    refused: Refusal | None
    usage: TenantUsage
    admitted_ms: int = 0  # the store's clock when it admitted the request (ms)


@dataclass(frozen=True, slots=True)
class Charge:
    """What a request that ended owes the ledger. Fixed when it ends, so a settlement retried
    later charges the same month and is recognised when it already landed."""

    tokens: int
    month: str  # the calendar month (UTC) the request ended in
    # The store's clock at admission (Verdict.admitted_ms); None: admitted while the store did
    # not answer (fail-open), so the settlement also counts the request.
    admitted_ms: int | None


class Ledger(Protocol):
    async def admit(self, tenant: Tenant, lease: str) -> Verdict:
        """Check the tenant's limits and, when they allow it, count the request and take a
        concurrency lease named `lease`."""
        ...

    async def settle(self, tenant: Tenant, lease: str, charge: Charge) -> None:
        """The request ended: charge its tokens and give its lease back. Idempotent by lease:
        a settlement that already landed (its reply lost) changes nothing when retried."""
        ...

    async def usage(self, tenant: Tenant) -> TenantUsage: ...

    async def close(self) -> None: ...


def month_of(now: float) -> str:
    return time.strftime("%Y-%m", time.gmtime(now))


def seconds_to_next_month(now: float) -> float:
    year, month = time.gmtime(now)[:2]
    year, month = (year + 1, 1) if month == 12 else (year, month + 1)
    return calendar.timegm((year, month, 1, 0, 0, 0)) - now


def month_bounds(now: float) -> tuple[str, float, float]:
    """The calendar month (UTC) of `now`: its name, first and last second + 1."""
    year, month = time.gmtime(now)[:2]
    start = calendar.timegm((year, month, 1, 0, 0, 0))
    return month_of(now), float(start), now + seconds_to_next_month(now)


def refusal(
    limits: Limits, requests: int, tokens: int, month_tokens: int, concurrent: int
) -> Refusal | None:
    """The rule, on the counts before this request (the Redis script says the same in Lua)."""
    if limits.requests_per_minute is not None and requests >= limits.requests_per_minute:
        return "requests"
    if limits.tokens_per_minute is not None and tokens >= limits.tokens_per_minute:
        return "tokens"
    if limits.tokens_per_month is not None and month_tokens >= limits.tokens_per_month:
        return "quota"
    if limits.concurrent_requests is not None and concurrent >= limits.concurrent_requests:
        return "concurrency"
    return None


@dataclass
class _Account:
    window: int = -1
    requests: int = 0
    tokens: int = 0
    month: str = ""
    month_requests: int = 0
    month_tokens: int = 0
    leases: set[str] = field(default_factory=set)
    # Settled requests that were admitted open (never here: this store always answers; kept
    # so that both stores follow one contract).
    settled_open: set[str] = field(default_factory=set)

    def roll(self, window: int, month: str) -> None:
        if window != self.window:
            self.window, self.requests, self.tokens = window, 0, 0
        if month != self.month:
            self.month, self.month_requests, self.month_tokens = month, 0, 0


class MemoryLedger:
    """The ledger of one process (no Redis configured): exact for that process alone."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.time) -> None:
        self.window_s, self.clock = window_s, clock
        self._accounts: dict[str, _Account] = {}
        self._month = ("", 0.0, 0.0)  # the calendar month and its bounds, computed once a month

    def _account(self, tenant: Tenant) -> tuple[_Account, float]:
        now = self.clock()
        if not self._month[1] <= now < self._month[2]:
            self._month = month_bounds(now)
        account = self._accounts.get(tenant.name)
        if account is None:
            account = self._accounts[tenant.name] = _Account()
        window = int(now // self.window_s)
        account.roll(window, self._month[0])
        return account, (window + 1) * self.window_s - now

    def _usage(self, account: _Account, reset_s: float) -> TenantUsage:
        return TenantUsage(
            requests=account.requests,
            tokens=account.tokens,
            month_requests=account.month_requests,
            month_tokens=account.month_tokens,
            concurrent=len(account.leases),
            reset_s=reset_s,
            month=account.month,
        )

    async def admit(self, tenant: Tenant, lease: str) -> Verdict:
        account, reset_s = self._account(tenant)
        refused = refusal(
            tenant.limits,
            account.requests,
            account.tokens,
            account.month_tokens,
            len(account.leases),
        )
        if refused is None:
            account.requests += 1
            account.month_requests += 1
            account.leases.add(lease)
        return Verdict(refused, self._usage(account, reset_s), round(self.clock() * 1000))

    async def settle(self, tenant: Tenant, lease: str, charge: Charge) -> None:
        account, _ = self._account(tenant)
        if lease in account.leases:
            account.leases.discard(lease)
        elif charge.admitted_ms is not None or lease in account.settled_open:
            return  # settled already
        else:  # admitted while the store did not answer
            account.settled_open.add(lease)
            account.requests += 1
            account.month_requests += 1
        account.tokens += charge.tokens
        account.month_tokens += charge.tokens

    async def usage(self, tenant: Tenant) -> TenantUsage:
        account, reset_s = self._account(tenant)
        return self._usage(account, reset_s)

    async def close(self) -> None:
        return None
