"""The bench's redis-py client answers as the gateway's own client does, on a real redis-server:
a hash as RESP's flat list (what the promotion store's pins are read from), a refused
command as ReplyError."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from loadtest.redispy_gateway import RedisPyClient
from service.tenancy.redis_client import RedisClient, ReplyError
from tests.fixtures.redis import running_redis


def test_redis_py_replies_in_the_lean_clients_shape(tmp_path: Path) -> None:
    async def both(url: str) -> None:
        lean, redis_py = RedisClient(url, deadline_s=2.0), RedisPyClient(url, deadline_s=2.0)
        try:
            await lean.call(b"HSET", b"pins", b"canary", b"0.25", b"base", b"0.75")
            lean_reply = await lean.call(b"HGETALL", b"pins")
            assert await redis_py.call(b"HGETALL", b"pins") == lean_reply
            assert len(lean_reply) == 4
            with pytest.raises(ReplyError):
                await redis_py.call(b"HGET", b"pins")  # wrong number of arguments
        finally:
            await lean.close()
            await redis_py.close()

    with running_redis(tmp_path) as server:
        asyncio.run(both(server.url))
