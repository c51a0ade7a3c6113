"""The lean RESP client against a real redis-server: replies, AUTH, pipelining, scripts that a
restarted Redis forgot, and deadlines that hold when Redis is down or silent."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.tenancy.redis_client import (
    RedisAddress,
    RedisClient,
    RedisUnavailable,
    ReplyError,
    RespParser,
    Script,
    encode,
)
from tests.fixtures.redis import running_redis
from tests.fixtures.worker import free_port

pytestmark = pytest.mark.anyio


def test_resp_parser_takes_replies_split_anywhere() -> None:
    wire = b"+OK\r\n:42\r\n$5\r\nhello\r\n$-1\r\n*3\r\n:1\r\n$0\r\n\r\n*1\r\n+x\r\n-ERR no\r\n"
    parser, replies = RespParser(), []
    for at in range(len(wire)):  # one byte at a time: every split point
        replies += parser.feed(wire[at : at + 1])
    assert replies[:5] == [b"OK", 42, b"hello", None, [1, b"", [b"x"]]]
    assert isinstance(replies[5], ReplyError) and str(replies[5]) == "ERR no"
    assert encode((b"GET", "k", 3)) == b"*3\r\n$3\r\nGET\r\n$1\r\nk\r\n$1\r\n3\r\n"


def test_urls() -> None:
    plain = RedisAddress.parse("redis://cache:6380/2")
    assert (plain.host, plain.port, plain.db, plain.password) == ("cache", 6380, 2, None)
    secret = RedisAddress.parse("redis://:p%40ss@127.0.0.1")
    assert (secret.port, secret.db, secret.password, secret.username) == (6379, 0, "p@ss", None)
    assert RedisAddress.parse("redis://user:pw@h/0").username == "user"
    assert "pw" not in repr(RedisAddress.parse("redis://user:pw@h/0"))
    tls = RedisAddress.parse("rediss://app:k@cache.example:6380/1")
    assert (tls.tls, tls.host, tls.port, tls.username, tls.password) == (
        True,
        "cache.example",
        6380,
        "app",
        "k",
    )
    for bad, message in [
        ("http://h", "redis://"),
        ("redis:///0", "no host"),
        ("redis://h/x", "number"),
    ]:
        with pytest.raises(ValueError, match=message):
            RedisAddress.parse(bad)


async def test_commands_pipeline_and_scripts_survive_a_restart(tmp_path: Path) -> None:
    with running_redis(tmp_path, password="s3cret") as server:
        client = RedisClient(server.url, deadline_s=2.0)
        replies = await asyncio.gather(*(client.call("INCR", "n") for _ in range(50)))
        assert sorted(replies) == list(range(1, 51))  # one connection, replies in order
        script = Script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
        assert await client.evalsha(script, ["m"], [5]) == 5
        server.command("SCRIPT", "FLUSH")  # what a restarted Redis has forgotten
        assert await client.evalsha(script, ["m"], [5]) == 10
        with pytest.raises(ReplyError, match="WRONGTYPE"):
            await client.call("LPUSH", "m", "x")
        assert await client.call("GET", "m") == b"10"  # an error reply keeps the connection
        await client.close()
        wrong = RedisClient(f"redis://:nope@127.0.0.1:{server.port}", deadline_s=2.0)
        with pytest.raises(RedisUnavailable):
            await wrong.call("PING")


async def test_a_dead_redis_fails_fast_then_is_reconnected(tmp_path: Path) -> None:
    with running_redis(tmp_path) as server:
        client = RedisClient(server.url, deadline_s=0.5, retry_after_s=0.3)
        assert await client.call("PING") == b"PONG"
        server.kill()
        started = time.monotonic()
        with pytest.raises(RedisUnavailable):
            await client.call("PING")
        with pytest.raises(RedisUnavailable, match="a moment ago"):  # no new attempt yet
            await client.call("PING")
        assert time.monotonic() - started < 0.5
        server.start()
        await asyncio.sleep(0.35)
        assert await client.call("PING") == b"PONG"
        await client.close()


@contextlib.contextmanager
def silent_server() -> Iterator[int]:
    """Accepts connections and never answers: a Redis stuck behind a network fault."""
    port = free_port()
    listener = socket.create_server(("127.0.0.1", port))
    try:
        yield port
    finally:
        listener.close()


async def test_a_silent_redis_costs_one_deadline(tmp_path: Path) -> None:
    with silent_server() as port:
        client = RedisClient(f"redis://127.0.0.1:{port}", deadline_s=0.2, retry_after_s=5)
        started = time.monotonic()
        results = await asyncio.gather(
            *(client.call("PING") for _ in range(5)), return_exceptions=True
        )
        assert all(isinstance(r, RedisUnavailable) for r in results)
        assert time.monotonic() - started < 0.6
        with pytest.raises(RedisUnavailable, match="a moment ago"):
            await client.call("PING")
        await client.close()
