"""The request path's HTTP/1.1 client to workers: keep-alive connections per worker, the
response parsed by httptools (the C parser uvicorn uses), the body handed over as it arrives.

Why not aiohttp: its general-purpose request setup (header merging, URL and payload objects,
tracing hooks, cookie jar, connector bookkeeping) was the largest single share of the
gateway's CPU per request. The gateway needs one thing: POST a JSON body to a worker it knows
and relay the answer. Deadlines are the proxy's (the first byte) and the watchdog's (idle,
total: `Body.set_exception`); only the TCP connect has its own.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

HIGH_WATER = 256 * 1024  # buffered body bytes at which reading from the worker pauses


class UpstreamIOError(Exception):
    """The connection to the worker failed."""


class ConnectFailed(UpstreamIOError):
    """No connection could be made (refused, unreachable, connect timeout)."""


class ReadFailed(UpstreamIOError):
    """The connection broke, or the worker sent something that is not HTTP/1.1."""


class Body:
    """The response body as it arrives (the subset of a stream reader the proxy uses)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._eof = False
        self._exception: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > HIGH_WATER:
            self._conn.pause()
        self._wake()

    def feed_eof(self) -> None:
        self._eof = True
        self._wake()

    def set_exception(self, exc: BaseException) -> None:
        """Fail the pending and every later read (a deadline, a drain, a broken connection)."""
        if self._exception is None and not self._eof:
            self._exception = exc
            self._wake(exc)

    def _wake(self, exc: BaseException | None = None) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)

    async def readany(self) -> bytes:
        """The bytes received so far (at least one), or b"" at the end."""
        while not self._chunks:
            if self._exception is not None:
                raise self._exception
            if self._eof:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        data = b"".join(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
        self._chunks.clear()
        self._size = 0
        self._conn.resume()
        return data

    async def read(self) -> bytes:
        parts = []
        while data := await self.readany():
            parts.append(data)
        return b"".join(parts)


class Response:
    def __init__(self, conn: Connection, status: int, headers: dict[str, str]) -> None:
        self.status, self.headers, self._conn = status, headers, conn
        self.content = conn.body

    def release(self) -> None:
        """The body was read to its end: the connection may serve the next request."""
        self._conn.done(reuse=True)

    def close(self) -> None:
        """Abandon the response: the connection closes (how a worker learns the client left)."""
        self._conn.done(reuse=False)


class Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, pool: ConnectionPool, key: Key) -> None:
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.body = Body(self)
        self.headers: dict[str, str] = {}
        self.head: asyncio.Future[Response] | None = None
        self.complete = False
        self.keep_alive = False
        self.closed = False
        self.paused = False

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ReadFailed(f"malformed HTTP from the worker: {exc}"))
            self._close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            self._fail(ReadFailed(f"the worker closed the connection ({exc or 'EOF'})"))

    # -- httptools callbacks -----------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self.head is not None and not self.head.done():
            status = self.parser.get_status_code()
            self.head.set_result(Response(self, status, self.headers))

    def on_body(self, body: bytes) -> None:
        self.body.feed(body)

    def on_message_complete(self) -> None:
        self.complete = True
        # Asked now: once the message is over the parser has reset and always says False.
        self.keep_alive = self.parser.should_keep_alive()
        self.body.feed_eof()

    # -- the request -------------------------------------------------------------------------
    def send(self, request: bytes) -> asyncio.Future[Response]:
        self.head = asyncio.get_running_loop().create_future()
        if self.body._exception is not None:  # a deadline missed before the request went out
            self.head.set_exception(self.body._exception)
            return self.head
        assert self.transport is not None
        self.transport.write(request)
        return self.head

    def set_exception(self, exc: BaseException) -> None:
        """A deadline or a drain, from the watchdog: fail the wait for the head or the body."""
        self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if self.head is not None and not self.head.done():
            self.head.set_exception(exc)
        self.body.set_exception(exc)

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def done(self, *, reuse: bool) -> None:
        if reuse and self.complete and not self.closed and self.keep_alive:
            self.pool.put_back(self)
        else:
            self._close()

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def fresh(self) -> Connection:
        """This connection, ready for the next request (new parser and body state)."""
        self.parser = httptools.HttpResponseParser(self)
        self.body = Body(self)
        self.headers = {}
        self.head = None
        self.complete = False
        self.keep_alive = False
        return self


@dataclass(frozen=True)
class Target:
    """A worker's address, parsed once."""

    host: str
    port: int
    tls: bool
    host_header: bytes

    @classmethod
    def of(cls, url: str) -> Target:
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        host = parts.hostname or ""
        port = parts.port or (443 if tls else 80)
        return cls(host, port, tls, parts.netloc.encode("idna"))


Key = tuple[str, int, bool]


class ConnectionPool:
    """Idle keep-alive connections per worker address."""

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        headers: Mapping[str, str],
        max_idle: int = 256,
        keepalive_s: float = 4.0,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self._idle: dict[Key, collections.deque[tuple[float, Connection]]] = {}
        self._tls: ssl.SSLContext | None = None
        self._static = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items())
        # Idle reuse window: below the worker's idle close (uvicorn's and vLLM's 5 s).
        self.keepalive_s = keepalive_s

    def put_back(self, conn: Connection) -> None:
        idle = self._idle.setdefault(conn.key, collections.deque())
        if len(idle) >= self.max_idle:
            conn._close()
            return
        idle.append((asyncio.get_running_loop().time(), conn.fresh()))

    def _take(self, key: Key) -> Connection | None:
        idle = self._idle.get(key)
        now = asyncio.get_running_loop().time()
        while idle:
            since, conn = idle.pop()
            if not conn.closed and now - since < self.keepalive_s:
                return conn
            conn._close()
        return None

    async def _connect(self, key: Key) -> Connection:
        loop = asyncio.get_running_loop()
        host, port, tls = key
        context = None
        if tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            context = self._tls
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: Connection(self, key),
                    host,
                    port,
                    ssl=context,
                    server_hostname=host if tls else None,
                )
        except (OSError, TimeoutError) as exc:
            raise ConnectFailed(f"cannot connect to {host}:{port}: {exc!r}") from None
        if conn.transport is not None:
            sock = conn.transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    async def post(
        self,
        target: Target,
        path: bytes,
        body: bytes,
        request_id: str,
        on_connection: Callable[[Connection], None],
        extra: bytes = b"",
    ) -> Response:
        """POST `body` (JSON) and wait for the response head. A reused connection that the
        worker had closed (it fails before any byte of an answer) is retried once on a new
        one: the request never reached the worker. `extra`: more header lines, each ending
        in CRLF (the trace context)."""
        request = b"".join(
            (
                b"POST ",
                path,
                b" HTTP/1.1\r\nhost: ",
                target.host_header,
                b"\r\ncontent-type: application/json\r\ncontent-length: ",
                str(len(body)).encode(),
                b"\r\nx-request-id: ",
                request_id.encode("latin-1"),
                b"\r\n",
                self._static,
                extra,
                b"\r\n",
                body,
            )
        )
        key = (target.host, target.port, target.tls)
        conn = self._take(key)
        if conn is not None:
            try:
                return await self._exchange(conn, request, on_connection)
            except ReadFailed:
                if conn.headers:  # the worker had begun to answer: not a stale connection
                    raise
        return await self._exchange(await self._connect(key), request, on_connection)

    @staticmethod
    async def _exchange(
        conn: Connection, request: bytes, on_connection: Callable[[Connection], None]
    ) -> Response:
        try:
            on_connection(conn)
            return await conn.send(request)
        except BaseException:  # failed, timed out or cancelled: the connection is spent
            conn._close()
            raise

    def close(self) -> None:
        for idle in self._idle.values():
            for _, conn in idle:
                conn._close()
        self._idle.clear()
