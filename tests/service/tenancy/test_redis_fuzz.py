"""The reply parser and the client under fuzzing (hypothesis, derandomized, bounded examples):
truncated, oversized, nested and malformed replies, split anywhere, from a server that answers
one byte at a time or closes mid-reply. Nothing but a store failure comes out (the gateway
then serves open or answers 503, never 500), memory stays bounded, and a connection that
carried bad bytes is dropped and made again."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.metrics import GatewayMetrics
from service.tenancy.limits import RateLimiter, Ticket
from service.tenancy.redis_client import (
    MAX_BULK,
    MAX_PENDING,
    ProtocolError,
    RedisClient,
    RedisUnavailable,
    RespParser,
)
from service.tenancy.redis_ledger import RedisLedger
from service.tenancy.tenants import Limits, Tenant
from tests.fixtures.resp_fuzz import (
    CORPUS,
    comparable,
    expected,
    mangled,
    outcome,
    replies,
    split,
    wire,
)
from wire.errors import Unavailable

BOUNDED = settings(
    max_examples=150,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
CUTS = st.lists(st.integers(1, 16), max_size=8)
WHO = Tenant("t", Limits(requests_per_minute=5))


@BOUNDED
@given(nodes=st.lists(replies, min_size=1, max_size=4), cuts=CUTS)
def test_good_replies_split_anywhere_parse_as_sent(nodes: list[object], cuts: list[int]) -> None:
    data = b"".join(wire(node) for node in nodes)  # type: ignore[arg-type]
    parser, got = RespParser(), []
    for chunk in split(data, cuts):
        got += parser.feed(chunk)
    assert [comparable(reply) for reply in got] == [expected(node) for node in nodes]  # type: ignore[arg-type]


@BOUNDED
@given(data=mangled(), cuts=CUTS)
def test_bad_bytes_raise_only_protocol_errors_within_bounds(data: bytes, cuts: list[int]) -> None:
    assert outcome(data, cuts)  # anything but ProtocolError, or an overgrown buffer, fails


@pytest.mark.parametrize("path", sorted(CORPUS.glob("*.bin")), ids=lambda path: path.name)
def test_the_corpus(path: Path) -> None:
    data = path.read_bytes()
    for cuts in ([], [1] * min(len(data), 64), [3, 5, 7]):
        outcome(data, cuts)


def test_memory_is_bounded_whatever_a_reply_announces() -> None:
    with pytest.raises(ProtocolError, match="out of bounds"):  # refused before any byte
        RespParser().feed(b"$%d\r\n" % (MAX_BULK + 1))
    parser = RespParser()
    with pytest.raises(ProtocolError, match="longer than"):
        for _ in range(100):
            parser.feed(b"+" + b"x" * 1000)
    parser = RespParser()
    chunk = b"*5\r\n" + (b"$%d\r\n" % MAX_BULK + b"x" * MAX_BULK + b"\r\n") * 4
    with pytest.raises(ProtocolError, match="more than"):
        parser.feed(chunk + b"$%d\r\n" % MAX_BULK + b"x" * 65536)
    assert len(chunk) < MAX_PENDING + 2**20  # what it held before giving up


class Answers:
    """A fake Redis: answers every command with `reply`, whole or one byte at a time, then
    closes or keeps the connection open; counts the connections made."""

    def __init__(self) -> None:
        self.reply, self.one_byte, self.close = b"+PONG\r\n", False, False
        self.connections, self.writing = 0, 0
        self.handlers: set[asyncio.Task[None]] = set()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            while await reader.read(65536):
                self.writing += 1
                try:
                    for part in split(self.reply, [1] * len(self.reply) if self.one_byte else []):
                        writer.write(part)
                        await writer.drain()
                finally:
                    self.writing -= 1
                if self.close:
                    break
        except OSError:
            pass
        finally:
            writer.close()

    async def stop(self, server: asyncio.Server) -> None:
        """After the client closed: each handler sees its connection end (none is left to be
        cancelled when the loop closes)."""
        server.close()
        pending = [task for task in self.handlers if not task.done()]
        if pending:
            await asyncio.wait(pending, timeout=2)

    async def quiet(self) -> None:
        """Until every answer is written, and the client had a moment to read it (bytes no
        command asked for must reach it before the next command goes out)."""
        for _ in range(200):
            if not self.writing:
                break
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.005)


async def scenario(data: bytes, one_byte: bool, close: bool, mode: str) -> None:
    fake = Answers()
    server = await asyncio.start_server(fake.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = RedisClient(f"redis://127.0.0.1:{port}", deadline_s=0.05, retry_after_s=0)
    limiter = RateLimiter(RedisLedger(client, 60, 60), GatewayMetrics(), mode)  # type: ignore[arg-type]
    fake.reply, fake.one_byte, fake.close = data, one_byte, close
    started = time.monotonic()
    try:
        ticket = await limiter.admit(WHO, "m")
        assert isinstance(ticket, Ticket) and ticket.admitted_ms is None  # served open
    except Unavailable:
        assert mode == "closed"  # a 503 with Retry-After, never a 500
    assert time.monotonic() - started < 1.0
    await fake.quiet()
    fake.reply, fake.one_byte, fake.close = b"+PONG\r\n", False, False
    dropped, before = client._writer is None, fake.connections
    client.deadline_s = 5.0  # recovery is checked, not speed (a loaded machine is slow)
    assert await client.call("PING") == b"PONG"  # the client recovered
    assert fake.connections == before + dropped  # on a new connection if the old one went
    await limiter.backlog.flush(0)
    await client.close()
    await fake.stop(server)


@settings(BOUNDED, max_examples=60)
@given(
    data=mangled(),
    one_byte=st.booleans(),
    close=st.booleans(),
    mode=st.sampled_from(["open", "closed"]),
)
def test_the_limiter_over_a_server_that_answers_anything(
    data: bytes, one_byte: bool, close: bool, mode: str
) -> None:
    asyncio.run(scenario(data, one_byte, close, mode))


@pytest.mark.anyio
async def test_a_server_that_closes_mid_reply_is_reconnected() -> None:
    fake = Answers()
    server = await asyncio.start_server(fake.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = RedisClient(f"redis://127.0.0.1:{port}", deadline_s=0.5, retry_after_s=0)
    fake.reply, fake.one_byte, fake.close = b"*2\r\n:1\r\n$5\r\nhe", True, True
    with pytest.raises(RedisUnavailable, match="closed the connection"):
        await client.call("GET", "k")
    fake.reply, fake.close = b"$5\r\nhello\r\n", False
    assert await client.call("GET", "k") == b"hello"  # one byte at a time, on a new connection
    assert fake.connections == 2
    fake.reply = b"$5\r\nhello\r\n!!"  # a byte no command asked for: out of step
    with pytest.raises(RedisUnavailable):
        await client.call("GET", "k")
        await client.call("GET", "k")
    fake.reply = b"+PONG\r\n"
    assert await client.call("PING") == b"PONG"
    assert fake.connections == 3
    await client.close()
    await fake.stop(server)
