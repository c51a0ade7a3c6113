"""Settlements the store missed are retried until they land, from a bounded queue; what is
given up is counted by reason."""

from __future__ import annotations

import asyncio

import pytest

from service.metrics import GatewayMetrics
from service.tenancy import ledger_backlog
from service.tenancy.ledger import Charge
from service.tenancy.ledger_backlog import MAX_REJECTIONS, Backlog
from service.tenancy.redis_client import RedisUnavailable, ReplyError
from service.tenancy.tenants import Limits, Tenant

pytestmark = pytest.mark.anyio
WHO = Tenant("t", Limits())


class FlakyLedger:
    """Fails every settlement until `down` is cleared; then records what landed."""

    def __init__(self, error: Exception) -> None:
        self.down, self.error = True, error
        self.landed: list[str] = []
        self.tries = 0

    async def settle(self, tenant: Tenant, lease: str, charge: Charge) -> None:
        self.tries += 1
        if self.down:
            raise self.error
        self.landed.append(lease)


def series(metrics: GatewayMetrics, name: str) -> float:
    for line in metrics.render()[0].decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not exposed")


async def test_settlements_wait_until_the_store_answers_then_all_land() -> None:
    ledger, metrics = FlakyLedger(RedisUnavailable("down")), GatewayMetrics()
    backlog = Backlog(ledger, metrics, capacity=1000)  # type: ignore[arg-type]
    for index in range(150):  # more than one batch
        backlog.put(WHO, f"l{index}", Charge(1, "2026-11", index))
    await asyncio.sleep(0.3)
    assert ledger.landed == [] and len(backlog) == 150
    assert series(metrics, "dflash_rate_limit_ledger_backlog") == 150
    ledger.down = False
    await backlog.flush(5.0)
    assert sorted(ledger.landed) == sorted(f"l{index}" for index in range(150))
    assert series(metrics, "dflash_rate_limit_settle_retries_total") >= 150
    assert series(metrics, "dflash_rate_limit_ledger_backlog") == 0
    assert 'reason="shutdown"} 0.0' in metrics.render()[0].decode()


async def test_a_full_backlog_drops_the_oldest_and_counts_it() -> None:
    ledger, metrics = FlakyLedger(RedisUnavailable("down")), GatewayMetrics()
    backlog = Backlog(ledger, metrics, capacity=3)  # type: ignore[arg-type]
    for index in range(5):
        backlog.put(WHO, f"l{index}", Charge(1, "2026-11", None))
    ledger.down = False
    await backlog.flush(5.0)
    assert len(ledger.landed) == 3 and "l4" in ledger.landed  # the newest are kept
    text = metrics.render()[0].decode()
    assert 'dflash_rate_limit_ledger_lost_total{reason="backlog_full"} 2.0' in text


async def test_error_replies_are_retried_a_while_then_given_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The backoff still doubles, to a ceiling of 0.1 s instead of 1 s: twenty error replies
    # in about 2 s instead of 16.
    monkeypatch.setattr(ledger_backlog, "RETRY_MAX_S", 0.1)
    ledger, metrics = FlakyLedger(ReplyError("LOADING Redis is loading")), GatewayMetrics()
    backlog = Backlog(ledger, metrics, capacity=10)  # type: ignore[arg-type]
    backlog.put(WHO, "l", Charge(1, "2026-11", 1))
    await backlog.flush(30.0)
    assert ledger.tries == MAX_REJECTIONS and ledger.landed == []
    text = metrics.render()[0].decode()
    assert 'dflash_rate_limit_ledger_lost_total{reason="rejected"} 1.0' in text
