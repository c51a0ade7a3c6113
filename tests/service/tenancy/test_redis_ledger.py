"""What only the Redis ledger has: keys that expire, leases that a dead gateway cannot hold
for ever, and a Redis restart that loses no more than the counts it held."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from service.tenancy.ledger import Charge, Verdict, month_of
from service.tenancy.redis_client import RedisClient, RedisUnavailable
from service.tenancy.redis_ledger import RedisLedger, limit_args, prefix
from service.tenancy.tenants import Limits, Tenant
from tests.fixtures.redis import running_redis

pytestmark = pytest.mark.anyio


async def test_leases_expire_and_keys_carry_ttls(tmp_path: Path) -> None:
    with running_redis(tmp_path) as server:
        ledger = RedisLedger(RedisClient(server.url, deadline_s=2), window_s=60, lease_s=0.3)
        who = Tenant("acme", Limits(concurrent_requests=1, tokens_per_minute=10))
        assert (await ledger.admit(who, "gone")).refused is None  # its gateway died: no settle
        assert (await ledger.admit(who, "next")).refused == "concurrency"
        await asyncio.sleep(0.35)
        verdict = await ledger.admit(who, "next")
        assert verdict.refused is None
        await ledger.settle(who, "next", Charge(4, month_of(time.time()), verdict.admitted_ms))
        keys = server.command("KEYS", "*").split()
        assert keys and all(key.startswith(prefix(who)) for key in keys)
        for key in keys:
            assert int(server.command("PTTL", key)) > 0, key  # nothing is kept for ever
        server.kill()
        server.start()  # no persistence: everything is gone, scripts too
        verdict = await admit_after_reconnect(ledger, who)
        assert verdict.refused is None and verdict.usage.requests == 1
        await ledger.close()


async def admit_after_reconnect(ledger: RedisLedger, who: Tenant) -> Verdict:
    """The client fails fast for a moment after the failure it saw; then it reconnects."""
    for _ in range(40):
        try:
            return await ledger.admit(who, "again")
        except RedisUnavailable:
            await asyncio.sleep(0.1)
    raise AssertionError("the ledger never reconnected")


def test_limits_travel_as_integers_with_minus_one_for_none() -> None:
    limits = Limits(requests_per_minute=5, concurrent_requests=2)
    assert limit_args(limits) == [5, -1, -1, 2]
    assert prefix(Tenant("a.b", Limits())) == "{dflash:a.b}:"


async def test_an_admission_that_missed_its_deadline_is_counted_once(tmp_path: Path) -> None:
    """The gateway gave up on an admission (served it open) that Redis ran anyway, before or
    after the request's settlement: either way one request, and no lease left held."""
    with running_redis(tmp_path) as server:
        ledger = RedisLedger(RedisClient(server.url, deadline_s=2), window_s=3600, lease_s=60)
        who = Tenant("acme", Limits(concurrent_requests=5))
        month = month_of(time.time())
        assert (await ledger.admit(who, "late")).refused is None  # ran; its reply was lost
        await ledger.settle(who, "late", Charge(3, month, None))
        await ledger.settle(who, "after", Charge(2, month, None))  # settled first...
        with pytest.raises(RedisUnavailable, match="settled before"):
            await ledger.admit(who, "after")  # ...then the admission arrives: ignored
        usage = await ledger.usage(who)
        assert (usage.month_requests, usage.month_tokens, usage.concurrent) == (2, 5, 0)
        await ledger.close()
