"""Settlements the ledger's store did not take yet, retried until they land.

A settlement that misses its deadline (Redis stalled, failing over, restarting, or this event
loop too busy to read the reply in time) must not leave its lease held until it expires, nor
its tokens uncharged; a request served while the store did not answer (fail-open) must still
be counted. So the settlement goes into a bounded queue, and one task retries the queue, in
batches, with a backoff, until each lands. Settlements are idempotent by lease
(service.tenancy.redis_ledger), so one that landed but whose reply was lost is not charged twice.

What can still be lost is counted in `dflash_rate_limit_ledger_lost_total` by reason:
`backlog_full` (the oldest settlement, when the queue is full), `rejected` (the store refused
one too many times with an error reply, e.g. a script it cannot run), and `shutdown` (still
queued when the gateway stopped and the store did not answer within the flush time).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass

from service.metrics import GatewayMetrics
from service.tenancy.ledger import Charge, Ledger
from service.tenancy.redis_client import RedisUnavailable, ReplyError
from service.tenancy.tenants import Tenant

log = logging.getLogger("dflash.gateway.limits")
BATCH = 64  # settlements in flight at once while the queue drains (one pipelined connection)
MAX_REJECTIONS = 20  # error replies to one settlement before it is given up
RETRY_FIRST_S, RETRY_MAX_S = 0.05, 1.0


@dataclass(slots=True)
class Pending:
    tenant: Tenant
    lease: str
    charge: Charge
    rejections: int = 0


class Backlog:
    def __init__(self, ledger: Ledger, metrics: GatewayMetrics, capacity: int) -> None:
        self.ledger, self.metrics, self.capacity = ledger, metrics, capacity
        self._queue: deque[Pending] = deque()
        self._in_flight: list[Pending] = []
        self._drainer: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return len(self._queue) + len(self._in_flight)

    def put(self, tenant: Tenant, lease: str, charge: Charge) -> None:
        """Queue a settlement that failed once; the drainer retries it."""
        if len(self._queue) >= self.capacity:
            self._queue.popleft()
            self.metrics.count_ledger_lost("backlog_full")
            log.error("ledger backlog full (%d): the oldest settlement is lost", self.capacity)
        self._queue.append(Pending(tenant, lease, charge))
        self._changed()
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        delay = RETRY_FIRST_S
        while self._queue:
            batch = [self._queue.popleft() for _ in range(min(BATCH, len(self._queue)))]
            self._in_flight = batch
            results = await asyncio.gather(
                *(self.ledger.settle(p.tenant, p.lease, p.charge) for p in batch),
                return_exceptions=True,
            )
            self._in_flight = []
            failed = [p for p, result in zip(batch, results, strict=True) if self._kept(p, result)]
            self._queue.extendleft(reversed(failed))
            while len(self._queue) > self.capacity:
                self._queue.pop()
                self.metrics.count_ledger_lost("backlog_full")
            self._changed()
            if failed:
                self.metrics.count_settle_retries(len(failed))
                await asyncio.sleep(delay)
                delay = min(RETRY_MAX_S, delay * 2)
            else:
                delay = RETRY_FIRST_S

    def _kept(self, pending: Pending, result: object) -> bool:
        """Whether a settlement goes back into the queue after this try."""
        if result is None:
            return False
        if isinstance(result, ReplyError):
            pending.rejections += 1
            if pending.rejections < MAX_REJECTIONS:
                return True  # LOADING, BUSY, OOM: Redis says no for now
            log.error(
                "ledger settlement given up after %d error replies: %s", MAX_REJECTIONS, result
            )
            self.metrics.count_ledger_lost("rejected")
            return False
        if isinstance(result, RedisUnavailable | OSError):
            return True
        log.error("ledger settlement failed: %r", result)  # a bug, not the store: not retried
        self.metrics.count_ledger_lost("rejected")
        return False

    def _changed(self) -> None:
        self.metrics.ledger_backlog.set(len(self))
        if len(self):
            self._idle.clear()
        else:
            self._idle.set()

    async def flush(self, timeout_s: float) -> None:
        """At shutdown: wait for the queue to drain, then count what is left as lost."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        if self._drainer is not None:
            self._drainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drainer
        if len(self):
            log.error("%d ledger settlements lost at shutdown: the store did not answer", len(self))
            self.metrics.count_ledger_lost("shutdown", len(self))
            self._queue.clear()
            self._in_flight = []
            self._changed()
