"""The in-process store of responses: per-tenant keys, TTL, the entry bound, deletes. (The
Redis store runs end to end in tests/service/test_responses.py, against a real redis-server.)"""

from __future__ import annotations

import pytest

from service.tenancy.response_store import MemoryResponseStore, redis_key

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_records_are_per_tenant_and_expire() -> None:
    clock = Clock()
    store = MemoryResponseStore(ttl_s=10, max_entries=5, clock=clock)
    record = {"response": {"id": "resp_1"}, "input_items": [], "conversation": []}
    await store.put("a", "resp_1", record)
    record["response"]["id"] = "changed"  # the stored copy is not the caller's object
    assert await store.get("a", "resp_1") == {
        "response": {"id": "resp_1"},
        "input_items": [],
        "conversation": [],
    }
    assert await store.get("b", "resp_1") is None
    assert not await store.delete("b", "resp_1")
    clock.now = 10.0
    assert await store.get("a", "resp_1") is None


async def test_the_oldest_go_beyond_the_bound_and_delete_removes() -> None:
    store = MemoryResponseStore(ttl_s=60, max_entries=2)
    for i in range(3):
        await store.put("a", f"resp_{i}", {"n": i})
    assert await store.get("a", "resp_0") is None
    assert await store.get("a", "resp_2") == {"n": 2}
    assert await store.delete("a", "resp_2")
    assert await store.get("a", "resp_2") is None


async def test_the_oldest_go_beyond_the_byte_bound() -> None:
    store = MemoryResponseStore(ttl_s=60, max_entries=100, max_bytes=100)
    for i in range(3):
        await store.put("a", f"resp_{i}", {"text": "x" * 30})  # 43 bytes of JSON each
    assert await store.get("a", "resp_0") is None
    assert await store.get("a", "resp_1") is not None and await store.get("a", "resp_2") is not None
    await store.put("a", "resp_2", {"text": "y"})  # a rewrite replaces, not adds
    assert await store.get("a", "resp_1") is not None


def test_redis_keys_share_the_tenant_hash_tag_of_the_ledger() -> None:
    assert redis_key("search", "resp_1") == "{dflash:search}:response:resp_1"
