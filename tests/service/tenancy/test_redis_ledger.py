"""What only the Redis ledger has: keys that expire, leases that a dead gateway cannot hold
for ever, and a Redis restart that loses no more than the counts it held."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from service.tenancy.ledger import Verdict
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
        assert (await ledger.admit(who, "next")).refused is None
        await ledger.settle(who, "next", 4)
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
