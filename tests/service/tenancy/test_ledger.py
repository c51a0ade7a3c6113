"""The ledger's rule, run against both stores: this process's (MemoryLedger) and a real
`redis-server` (RedisLedger's scripts). Same calls, same verdicts."""

from __future__ import annotations

import asyncio
import calendar
import time
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from service.tenancy.ledger import (
    Charge,
    Ledger,
    MemoryLedger,
    month_bounds,
    month_of,
    seconds_to_next_month,
)
from service.tenancy.redis_client import RedisClient
from service.tenancy.redis_ledger import RedisLedger
from service.tenancy.tenants import Limits, Tenant
from tests.fixtures.redis import RedisServer, running_redis

pytestmark = pytest.mark.anyio
Factory = Callable[[float], Ledger]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(params=["memory", "redis"])
async def make_ledger(
    request: pytest.FixtureRequest, redis_server: RedisServer
) -> AsyncIterator[Factory]:
    made: list[Ledger] = []

    def factory(window_s: float) -> Ledger:
        if request.param == "memory":
            ledger: Ledger = MemoryLedger(window_s)
        else:
            client = RedisClient(redis_server.url, deadline_s=2.0)
            ledger = RedisLedger(client, window_s, lease_s=60)
        made.append(ledger)
        return ledger

    redis_server.command("FLUSHALL")
    yield factory
    for ledger in made:
        await ledger.close()


def tenant(name: str = "t", **limits: int) -> Tenant:
    return Tenant(name, Limits(**limits))


async def fresh_window(window_s: float, need_s: float) -> None:
    """Start at a window's beginning when less than `need_s` of the current one is left."""
    left = window_s - time.time() % window_s
    if left < need_s:
        await asyncio.sleep(left + 0.01)


async def test_exactly_the_request_limit_is_admitted(make_ledger: Factory) -> None:
    ledger, who = make_ledger(3600), tenant(requests_per_minute=3)
    await fresh_window(3600, 5)
    verdicts = [await ledger.admit(who, f"l{i}") for i in range(5)]
    assert [v.refused for v in verdicts] == [None, None, None, "requests", "requests"]
    assert [v.usage.requests for v in verdicts] == [1, 2, 3, 3, 3]
    assert 0 < verdicts[0].usage.reset_s <= 3600
    usage = await ledger.usage(who)
    assert usage.requests == 3 and usage.month_requests == 3  # refusals are not counted


async def test_admissions_racing_from_two_clients_take_exactly_the_limit(
    make_ledger: Factory,
) -> None:
    """Two ledgers on one store stand for two gateway processes."""
    first, second = make_ledger(3600), make_ledger(3600)
    await fresh_window(3600, 5)
    who = tenant(requests_per_minute=17)
    if isinstance(first, MemoryLedger):
        second = first  # a process's own ledger is not shared: the race is within it
    verdicts = await asyncio.gather(
        *(ledger.admit(who, f"l{i}") for i in range(25) for ledger in (first, second))
    )
    assert sum(v.refused is None for v in verdicts) == 17


async def test_tokens_are_charged_at_settlement_and_then_refuse(make_ledger: Factory) -> None:
    ledger, who = make_ledger(3600), tenant(tokens_per_minute=100)
    await fresh_window(3600, 5)
    for lease in ("a", "b"):
        await serve(ledger, who, lease, 60)
    verdict = await ledger.admit(who, "c")
    assert verdict.refused == "tokens" and verdict.usage.tokens == 120
    usage = await ledger.usage(who)
    assert (usage.tokens, usage.month_tokens, usage.month) == (120, 120, month_of(time.time()))


async def test_the_monthly_quota_refuses_once_spent(make_ledger: Factory) -> None:
    ledger, who = make_ledger(3600), tenant(tokens_per_month=50)
    await serve(ledger, who, "a", 50)
    verdict = await ledger.admit(who, "b")
    assert verdict.refused == "quota" and verdict.usage.month_tokens == 50


async def test_the_concurrency_cap_holds_until_a_lease_is_given_back(
    make_ledger: Factory,
) -> None:
    ledger, who = make_ledger(3600), tenant(concurrent_requests=2)
    first = await ledger.admit(who, "a")
    assert first.refused is None
    assert (await ledger.admit(who, "b")).usage.concurrent == 2
    assert (await ledger.admit(who, "c")).refused == "concurrency"
    await ledger.settle(who, "a", charge(0, first.admitted_ms))
    assert (await ledger.usage(who)).concurrent == 1
    assert (await ledger.admit(who, "c")).refused is None


async def test_a_new_window_starts_from_zero_and_tenants_count_apart(
    make_ledger: Factory,
) -> None:
    ledger = make_ledger(1.0)
    one, other = tenant("one", requests_per_minute=1), tenant("other", requests_per_minute=1)
    await fresh_window(1.0, 0.5)
    assert (await ledger.admit(one, "a")).refused is None
    assert (await ledger.admit(other, "a")).refused is None
    refused = await ledger.admit(one, "b")
    assert refused.refused == "requests" and 0 < refused.usage.reset_s <= 1.0
    await asyncio.sleep(refused.usage.reset_s + 0.02)
    verdict = await ledger.admit(one, "c")
    assert verdict.refused is None and verdict.usage.requests == 1
    assert (await ledger.usage(one)).month_requests == 2


async def test_a_tenant_without_limits_is_counted_never_refused(make_ledger: Factory) -> None:
    ledger, who = make_ledger(3600), tenant()
    for lease in ("a", "b", "c"):
        await serve(ledger, who, lease, 7)
    usage = await ledger.usage(who)
    assert (usage.month_requests, usage.month_tokens, usage.concurrent) == (3, 21, 0)


async def test_a_settlement_counts_once_however_often_it_is_retried(
    make_ledger: Factory,
) -> None:
    """A retried settlement whose first try landed (its reply lost) charges nothing more; a
    request served while the store did not answer is counted by its settlement, once."""
    ledger, who = make_ledger(3600), tenant(concurrent_requests=1)
    await fresh_window(3600, 5)
    verdict = await ledger.admit(who, "a")
    for _ in range(3):
        await ledger.settle(who, "a", charge(5, verdict.admitted_ms))
    for _ in range(3):  # never admitted by the store: fail-open
        await ledger.settle(who, "open", charge(4, None))
    usage = await ledger.usage(who)
    assert (usage.requests, usage.month_requests, usage.tokens) == (2, 2, 9)
    assert usage.month_tokens == 9 and usage.concurrent == 0


def charge(tokens: int, admitted_ms: int | None) -> Charge:
    return Charge(tokens, month_of(time.time()), admitted_ms)


async def serve(ledger: Ledger, who: Tenant, lease: str, tokens: int) -> None:
    """A request admitted, then settled with its tokens."""
    verdict = await ledger.admit(who, lease)
    assert verdict.refused is None
    await ledger.settle(who, lease, charge(tokens, verdict.admitted_ms))


def test_memory_ledger_windows_follow_its_clock() -> None:
    now = [120.5]
    ledger = MemoryLedger(60, clock=lambda: now[0])
    who = tenant(requests_per_minute=1)
    assert asyncio.run(ledger.admit(who, "a")).usage.reset_s == pytest.approx(59.5)
    assert asyncio.run(ledger.admit(who, "b")).refused == "requests"
    now[0] = 180.0
    assert asyncio.run(ledger.admit(who, "c")).refused is None
    now[0] = calendar.timegm((2026, 12, 1, 0, 0, 0))  # a new month: its totals start at zero
    assert asyncio.run(ledger.usage(who)).month_requests == 0


def test_calendar_months_are_utc() -> None:
    end_of_november = calendar.timegm((2026, 11, 30, 23, 59, 0))
    name, start, end = month_bounds(end_of_november)
    assert name == "2026-11" and end == end_of_november + 60
    assert start == calendar.timegm((2026, 11, 1, 0, 0, 0))
    assert month_of(end_of_november) == "2026-11" and month_of(end_of_november + 60) == "2026-12"
    assert seconds_to_next_month(end_of_november) == 60
    assert seconds_to_next_month(calendar.timegm((2026, 12, 31, 0, 0, 0))) == 86400
