"""Stored responses (`store: true`): the response object, its input items and the whole
conversation a `previous_response_id` continues. Kept where the tenants' ledger is: in this
process by default, in Redis with REDIS_URL (so every gateway process and replica sees them).

Each record is scoped to the tenant that created it (the key includes the tenant: another
tenant's lookup misses, a 404), expires after a TTL, and is bounded in size; the in-process
store also holds at most `max_entries` records (the oldest go first).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from service.tenancy.redis_client import RedisClient, RedisUnavailable, ReplyError

Record = dict[str, Any]  # {"response": {...}, "input_items": [...], "conversation": [...]}


class ResponseStore(Protocol):
    async def put(self, tenant: str, response_id: str, record: Record) -> None: ...

    async def get(self, tenant: str, response_id: str) -> Record | None: ...

    async def delete(self, tenant: str, response_id: str) -> bool: ...

    async def close(self) -> None: ...


class MemoryResponseStore:
    """At most `max_entries` records and `max_bytes` of JSON in all: the oldest go first."""

    def __init__(
        self,
        ttl_s: float,
        max_entries: int,
        max_bytes: int = 256 * 1024 * 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s, self.max_entries, self.max_bytes = ttl_s, max_entries, max_bytes
        self._clock = clock
        self._records: OrderedDict[tuple[str, str], tuple[float, str]] = OrderedDict()
        self._bytes = 0

    async def put(self, tenant: str, response_id: str, record: Record) -> None:
        # Serialized, as Redis keeps it: a caller's later change cannot reach the stored copy.
        self._drop((tenant, response_id))
        data = json.dumps(record)
        self._records[(tenant, response_id)] = (self._clock() + self.ttl_s, data)
        self._bytes += len(data)
        while len(self._records) > self.max_entries or self._bytes > self.max_bytes:
            self._drop(next(iter(self._records)))

    def _drop(self, key: tuple[str, str]) -> bool:
        found = self._records.pop(key, None)
        if found is not None:
            self._bytes -= len(found[1])
        return found is not None

    async def get(self, tenant: str, response_id: str) -> Record | None:
        found = self._records.get((tenant, response_id))
        if found is None:
            return None
        if found[0] <= self._clock():
            self._drop((tenant, response_id))
            return None
        record: Record = json.loads(found[1])
        return record

    async def delete(self, tenant: str, response_id: str) -> bool:
        return await self.get(tenant, response_id) is not None and self._drop((tenant, response_id))

    async def close(self) -> None:
        self._records.clear()
        self._bytes = 0


def redis_key(tenant: str, response_id: str) -> str:
    # The ledger's hash tag per tenant ({dflash:NAME}): a tenant's keys share a cluster slot.
    return f"{{dflash:{tenant}}}:response:{response_id}"


class RedisResponseStore:
    """SET with EX (Redis expires it), GET, DEL; the size bound is the gateway's, checked
    before a record is written (service/responses.py). A call that fails is counted
    (`on_error(operation)`: write, read, delete) and raised as RedisUnavailable, an error
    reply included: the caller skips the write or answers 503 either way."""

    def __init__(
        self,
        client: RedisClient,
        ttl_s: float,
        on_error: Callable[[str], None] = lambda operation: None,
    ) -> None:
        self.client, self.ttl_s, self.on_error = client, ttl_s, on_error

    async def _call(self, operation: str, *args: Any) -> Any:
        try:
            return await self.client.call(*args)
        except RedisUnavailable:
            self.on_error(operation)
            raise
        except ReplyError as exc:  # OOM under maxmemory, READONLY after a failover, ...
            self.on_error(operation)
            raise RedisUnavailable(f"Redis refused the {operation}: {exc}") from exc

    async def put(self, tenant: str, response_id: str, record: Record) -> None:
        data = json.dumps(record, separators=(",", ":"))
        key = redis_key(tenant, response_id)
        await self._call("write", "SET", key, data, "EX", int(self.ttl_s))

    async def get(self, tenant: str, response_id: str) -> Record | None:
        data = await self._call("read", "GET", redis_key(tenant, response_id))
        if data is None:
            return None
        record: Record = json.loads(data)
        return record

    async def delete(self, tenant: str, response_id: str) -> bool:
        return bool(await self._call("delete", "DEL", redis_key(tenant, response_id)))

    async def close(self) -> None:
        await self.client.close()
