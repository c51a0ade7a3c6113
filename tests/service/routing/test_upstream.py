"""The lean upstream client against a raw fake worker: keep-alive reuse, chunked bodies,
a stale kept-alive connection, errors of each kind, and read deadlines via set_exception."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from service.routing.upstream import ConnectFailed, ConnectionPool, ReadFailed, Target
from tests.fixtures.worker import free_port

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Server:
    """Counts connections; answers each request with `reply(n)` (n: its number)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.connections = 0
        self.requests: list[bytes] = []
        self.reply = lambda n: b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
        self.close_after_reply = False

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                for part in self.reply(len(self.requests)):
                    writer.write(part if isinstance(part, bytes) else bytes([part]))
                    await writer.drain()
                if self.close_after_reply:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    fake = Server()
    listener = await asyncio.start_server(fake.handle, "127.0.0.1", fake.port)
    async with listener:
        yield fake


def ignore(_: object) -> None:
    """No watchdog here: the connection a request goes out on is of no interest."""


def target(port: int) -> Target:
    return Target.of(f"http://127.0.0.1:{port}")


async def test_keep_alive_reuses_one_connection(server: Server) -> None:
    pool = ConnectionPool(connect_timeout_s=1, headers={"Accept-Encoding": "identity"})
    for i in range(3):
        response = await pool.post(target(server.port), b"/v1/x", b"{}", f"id{i}", ignore)
        assert response.status == 200 and await response.content.read() == b"ok"
        response.release()
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /v1/x HTTP/1.1\r\n")
    for header in (b"accept-encoding: identity", b"x-request-id: id0", b"content-length: 2"):
        assert header in first.lower()
    pool.close()


@pytest.mark.parametrize(("keepalive_s", "connections"), [(0.05, 2), (5.0, 1)])
async def test_idle_connections_are_reused_for_keepalive_s_only(
    server: Server, keepalive_s: float, connections: int
) -> None:
    pool = ConnectionPool(connect_timeout_s=1, headers={}, keepalive_s=keepalive_s)
    for i in range(2):
        response = await pool.post(target(server.port), b"/", b"{}", f"r{i}", ignore)
        assert await response.content.read() == b"ok"
        response.release()
        await asyncio.sleep(0.2)  # idle longer than the short window, shorter than the long
    assert server.connections == connections
    pool.close()


async def test_chunked_body_arrives_in_parts(server: Server) -> None:
    server.reply = lambda n: [
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n",
        b"3\r\nabc\r\n",
        b"2\r\nde\r\n0\r\n\r\n",
    ]
    pool = ConnectionPool(connect_timeout_s=1, headers={})
    response = await pool.post(target(server.port), b"/", b"{}", "r", ignore)
    assert response.headers["content-type"] == "text/event-stream"
    assert await response.content.read() == b"abcde"
    response.release()
    pool.close()


async def test_a_stale_kept_alive_connection_is_replaced(server: Server) -> None:
    server.close_after_reply = True  # the worker closes idle connections (keep-alive end)
    pool = ConnectionPool(connect_timeout_s=1, headers={})
    for _ in range(2):
        response = await pool.post(target(server.port), b"/", b"{}", "r", ignore)
        assert await response.content.read() == b"ok"
        response.release()
        await asyncio.sleep(0.05)
    assert server.connections == 2
    pool.close()


async def test_connect_and_read_failures_are_told_apart(server: Server) -> None:
    pool = ConnectionPool(connect_timeout_s=1, headers={})
    with pytest.raises(ConnectFailed):
        await pool.post(target(free_port()), b"/", b"{}", "r", ignore)
    server.reply = lambda n: [b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc"]
    server.close_after_reply = True
    response = await pool.post(target(server.port), b"/", b"{}", "r", ignore)
    with pytest.raises(ReadFailed):
        await response.content.read()  # 3 of 10 bytes, then the connection closed
    server.reply = lambda n: [b"NOT HTTP\r\n\r\n"]
    with pytest.raises(ReadFailed):
        await pool.post(target(server.port), b"/", b"{}", "r", ignore)
    pool.close()


async def test_set_exception_wakes_a_pending_read(server: Server) -> None:
    server.reply = lambda n: [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n"]
    pool = ConnectionPool(connect_timeout_s=1, headers={})
    response = await pool.post(target(server.port), b"/", b"{}", "r", ignore)
    assert await response.content.readany() == b"a"
    asyncio.get_running_loop().call_later(0.05, response.content.set_exception, TimeoutError())
    with pytest.raises(TimeoutError):
        await response.content.readany()
    response.close()
    pool.close()
