"""The in-process store of responses: per-tenant keys, TTL, the entry bound, deletes; the Redis
store's error replies, against a real redis-server. (The Redis store runs end to end, and down,
in tests/service/test_responses.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from service.tenancy.redis_client import RedisClient, RedisUnavailable
from service.tenancy.response_store import MemoryResponseStore, RedisResponseStore, redis_key
from tests.fixtures.redis import running_redis

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


async def test_a_redis_error_reply_is_counted_as_the_store_being_away(tmp_path: Path) -> None:
    """A real redis-server over its memory bound (noeviction): SET gets an OOM error reply,
    which the caller sees as RedisUnavailable (the write skipped, a read answered 503), and
    on_error counts it by operation; reads still work."""
    failed: list[str] = []
    args = ["--maxmemory", "1", "--maxmemory-policy", "noeviction"]
    with running_redis(tmp_path, args=args) as server:
        client = RedisClient(server.url, deadline_s=2.0)
        store = RedisResponseStore(client, ttl_s=60, on_error=failed.append)
        try:
            with pytest.raises(RedisUnavailable, match="OOM"):
                await store.put("a", "resp_1", {"n": 1})
            assert await store.get("a", "resp_1") is None
        finally:
            await store.close()
    assert failed == ["write"]
