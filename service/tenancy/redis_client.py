"""A lean Redis client for the rate-limit ledger: RESP2 over one pipelined connection.

The ledger sends one script call per admission and one per settlement, from every request of
every tenant with limits, so the client's CPU is on the request path (redis-py's asyncio client
costs several times more per call). It speaks only what the ledger needs: AUTH (a password,
or an ACL user and password), SELECT, EVALSHA with SCRIPT LOAD on NOSCRIPT, and plain commands
for tests and tools; over TCP or TLS (rediss://, as managed Redis requires).

Its parser is on the request path and bounds what a reply may hold (sizes, nesting, bytes
pending): bytes that are not such a reply drop the connection like any other failure.

Every call has a deadline. A failure (refused, reset, deadline) fails the calls in flight,
drops the connection and fails new calls at once for `retry_after_s` before the next connect
attempt, so a Redis that is down costs nothing per request but the fallback decision.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import re
import ssl
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

Reply = Any  # int | bytes | None | list[Reply] | ReplyError


class RedisUnavailable(Exception):
    """Redis could not answer in time (down, unreachable, slow, or failed a moment ago)."""


class ReplyError(Exception):
    """An error reply (`-ERR ...`): the command was wrong, not the connection."""


@dataclass(frozen=True)
class RedisAddress:
    host: str
    port: int
    db: int
    username: str | None
    password: str | None = field(repr=False)
    tls: bool = False

    @classmethod
    def parse(cls, url: str) -> RedisAddress:
        """redis[s]://[[user]:password@]host[:port][/db] (rediss: TLS)"""
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError(f"a Redis URL starts with redis:// or rediss://, got {parts.scheme!r}")
        if not parts.hostname:
            raise ValueError("the Redis URL names no host")
        db = parts.path.lstrip("/")
        if db and not db.isdigit():
            raise ValueError(f"the Redis URL's database must be a number, got {db!r}")
        return cls(
            host=parts.hostname,
            port=parts.port or 6379,
            db=int(db or 0),
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password else None,
            tls=parts.scheme == "rediss",
        )


@dataclass(frozen=True)
class TlsFiles:
    """How a rediss:// connection checks the server and proves the client: a CA bundle (None:
    the system's store), a client certificate and key (mutual TLS), or no check at all."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    verify: bool = True


def tls_context(files: TlsFiles) -> ssl.SSLContext:
    """The server's certificate is checked against the CA and its name against the URL's host,
    unless `verify` is off. Reads the files now: a missing or bad one stops startup."""
    context = ssl.create_default_context(cafile=files.ca_file)
    if not files.verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if files.cert_file is not None:
        context.load_cert_chain(files.cert_file, files.key_file)
    return context


@dataclass(frozen=True)
class Script:
    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


def encode(args: tuple[Any, ...]) -> bytes:
    """A command as RESP: an array of bulk strings (two calls per request: kept lean)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts += (b"$%d\r\n" % len(data), data, b"\r\n")
    return b"".join(parts)


class ProtocolError(RedisUnavailable):
    """Redis's bytes are not a reply this client takes (malformed, or over a size limit): the
    connection is out of step and is dropped."""


# Limits on what one reply may hold. The ledger's replies are a few dozen bytes; a peer that
# is not Redis, or a corrupted stream, must cost bounded memory and no recursion blow-up.
MAX_LINE = 4096  # a status, error or integer line
MAX_BULK = 1 << 20  # one bulk string
MAX_ARRAY = 1024  # elements of one array
MAX_DEPTH = 8  # arrays inside arrays
MAX_PENDING = 4 << 20  # bytes of one reply not complete yet
_INTEGER = re.compile(rb"-?[0-9]{1,19}")


def integer(line: bytes, low: int, high: int) -> int:
    if not _INTEGER.fullmatch(line):
        raise ProtocolError(f"not a RESP integer: {line[:32]!r}")
    value = int(line)
    if not low <= value <= high:
        raise ProtocolError(f"RESP length {value} is out of bounds")
    return value


class RespParser:
    """Incremental RESP2 parser: feed bytes, take complete replies. Raises ProtocolError on
    anything else, and holds at most MAX_PENDING bytes of an incomplete reply."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Reply]:
        self._buf += data
        replies: list[Reply] = []
        at = 0
        while True:
            parsed = self._parse(at, 0)
            if parsed is None:
                break
            reply, at = parsed
            replies.append(reply)
        del self._buf[:at]
        if len(self._buf) > MAX_PENDING:
            raise ProtocolError(f"a reply of more than {MAX_PENDING} bytes")
        return replies

    def _line(self, at: int) -> tuple[bytes, int] | None:
        line_end = self._buf.find(b"\r\n", at, at + MAX_LINE + 2)
        if line_end < 0:
            if len(self._buf) - at > MAX_LINE:
                raise ProtocolError(f"a RESP line longer than {MAX_LINE} bytes")
            return None
        return bytes(self._buf[at:line_end]), line_end + 2

    def _parse(self, at: int, depth: int) -> tuple[Reply, int] | None:
        if at >= len(self._buf):
            return None
        kind = self._buf[at : at + 1]
        found = self._line(at + 1)
        if found is None:
            return None
        line, after = found
        if kind == b"+":
            return line, after
        if kind == b"-":
            return ReplyError(line.decode(errors="replace")), after
        if kind == b":":
            return integer(line, -(2**63), 2**63 - 1), after
        if kind == b"$":
            return self._bulk(integer(line, -1, MAX_BULK), after)
        if kind == b"*":
            return self._array(integer(line, -1, MAX_ARRAY), after, depth)
        raise ProtocolError(f"not a RESP reply: {bytes(kind)!r}")

    def _bulk(self, size: int, at: int) -> tuple[Reply, int] | None:
        if size < 0:
            return None, at
        if len(self._buf) < at + size + 2:
            return None
        if self._buf[at + size : at + size + 2] != b"\r\n":
            raise ProtocolError("a bulk string does not end where its length says")
        return bytes(self._buf[at : at + size]), at + size + 2

    def _array(self, count: int, at: int, depth: int) -> tuple[Reply, int] | None:
        if count < 0:
            return None, at
        if depth >= MAX_DEPTH:
            raise ProtocolError(f"arrays nested deeper than {MAX_DEPTH}")
        items: list[Reply] = []
        for _ in range(count):
            parsed = self._parse(at, depth + 1)
            if parsed is None:
                return None
            item, at = parsed
            items.append(item)
        return items, at


class RedisClient:
    """One connection, commands pipelined: replies come back in order, so each call waits on
    a future at the end of a queue."""

    def __init__(
        self,
        url: str,
        *,
        deadline_s: float,
        retry_after_s: float = 1.0,
        password: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        address = RedisAddress.parse(url)
        if password is not None:  # given apart from the URL (a Secret): it wins
            address = dataclasses.replace(address, password=password)
        self.address = address
        self._tls = tls if tls is not None or not address.tls else tls_context(TlsFiles())
        self.deadline_s, self.retry_after_s = deadline_s, retry_after_s
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._waiting: deque[asyncio.Future[Reply]] = deque()
        self._connecting: asyncio.Future[None] | None = None
        self._down_until = 0.0
        self._loaded: set[str] = set()

    async def call(self, *args: Any) -> Reply:
        """One command; raises RedisUnavailable (connection) or ReplyError (the command)."""
        if time.monotonic() < self._down_until:
            raise RedisUnavailable("Redis failed a moment ago")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.deadline_s
        if self._writer is None:
            await self._connect(deadline)
        if self._writer is None:  # opened, then lost at once
            raise RedisUnavailable("the connection to Redis closed as it opened")
        future: asyncio.Future[Reply] = loop.create_future()
        self._waiting.append(future)
        self._writer.write(encode(args))
        timer = loop.call_at(deadline, self._expire, future)
        try:
            reply = await future
        finally:
            timer.cancel()
        if isinstance(reply, ReplyError):
            raise reply
        return reply

    async def evalsha(self, script: Script, keys: list[str], args: list[Any]) -> Reply:
        """The script by its digest, loaded once per connection when Redis does not know it
        (a restarted Redis forgets scripts: NOSCRIPT loads it again)."""
        if script.sha not in self._loaded:
            await self.call(b"SCRIPT", b"LOAD", script.source)
            self._loaded.add(script.sha)
        try:
            return await self.call(b"EVALSHA", script.sha, len(keys), *keys, *args)
        except ReplyError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
            self._loaded.discard(script.sha)
            await self.call(b"SCRIPT", b"LOAD", script.source)
            self._loaded.add(script.sha)
            return await self.call(b"EVALSHA", script.sha, len(keys), *keys, *args)

    async def close(self) -> None:
        self._drop(RedisUnavailable("client closed"))

    def drop_connection(self, reason: BaseException) -> None:
        """A reply that Redis would never send for the command (the wrong shape): the stream
        may be out of step, so the connection goes, as after any failure."""
        self._fail(reason)

    async def _connect(self, deadline: float) -> None:
        """Open the connection, or wait for the opening under way (a connect that outlives
        one call's deadline goes on and serves the calls after it)."""
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._open())
            # Retrieved here, so an opening nobody waits for any more logs nothing.
            self._connecting.add_done_callback(lambda task: task.cancelled() or task.exception())
        connecting = self._connecting
        try:
            timeout = max(0.0, deadline - asyncio.get_running_loop().time())
            await asyncio.wait_for(asyncio.shield(connecting), timeout)
        except (OSError, TimeoutError, ReplyError, RedisUnavailable) as exc:
            self._fail(exc)
            raise RedisUnavailable(f"cannot connect to Redis: {exc!r}") from None
        finally:
            if connecting.done():
                self._connecting = None

    async def _open(self) -> None:
        address = self.address
        if self._tls is None:
            reader, writer = await asyncio.open_connection(address.host, address.port)
        else:  # the host name is checked against the certificate (unless verify is off)
            reader, writer = await asyncio.open_connection(
                address.host, address.port, ssl=self._tls, server_hostname=address.host
            )
        self._writer = writer
        self._loaded.clear()
        self._reader_task = asyncio.ensure_future(self._read(reader))
        if address.password is not None:
            auth = (address.username, address.password) if address.username else (address.password,)
            await self._handshake(b"AUTH", *auth)
        if address.db:
            await self._handshake(b"SELECT", address.db)

    async def _handshake(self, *args: Any) -> None:
        assert self._writer is not None
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        self._writer.write(encode(args))
        reply = await future
        if isinstance(reply, ReplyError):
            raise reply

    async def _read(self, reader: asyncio.StreamReader) -> None:
        parser, replied = RespParser(), False
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    raise ConnectionResetError("Redis closed the connection")
                for reply in parser.feed(data):
                    replied = True
                    future = self._waiting.popleft()
                    if not future.done():
                        future.set_result(reply)
        except (OSError, RedisUnavailable, IndexError) as exc:
            # IndexError: a reply nobody asked for (the stream is out of step).
            if isinstance(exc, OSError) and self._tls is not None and not replied:
                # TLS 1.3 ends the handshake before the server checks the client's
                # certificate: its refusal comes as a reset of the first command.
                exc = ConnectionResetError(
                    f"{exc!r}: Redis closed the TLS connection before its first reply: does "
                    "it require a client certificate (redis_tls_cert_file, redis_tls_key_file)?"
                )
            self._fail(exc)

    def _expire(self, future: asyncio.Future[Reply]) -> None:
        """The deadline passed: the connection's replies can no longer be matched to the
        calls that are still waiting (a late reply would answer the wrong call), so it goes."""
        if not future.done():
            self._fail(TimeoutError(f"no reply within {self.deadline_s} s"))

    def _fail(self, exc: BaseException) -> None:
        self._down_until = time.monotonic() + self.retry_after_s
        self._drop(RedisUnavailable(f"Redis failed: {exc!r}"))

    def _drop(self, error: RedisUnavailable) -> None:
        writer, task = self._writer, self._reader_task
        self._writer, self._reader_task = None, None
        waiting, self._waiting = self._waiting, deque()
        for future in waiting:
            if not future.done():
                future.set_exception(error)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        if writer is not None:
            writer.close()
