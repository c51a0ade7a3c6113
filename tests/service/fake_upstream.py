"""A misbehaving worker for fault tests: raw asyncio HTTP/1.1 in a thread. It answers /health,
/metrics and /v1/models like a worker serving `MODEL`; every POST goes to the test's `handler`,
which writes whatever bytes (or silence) the fault needs."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from tests.fixtures.worker import free_port

MODEL = "fake"
MODELS = b'{"object":"list","data":[{"id":"fake","object":"model","owned_by":"test"}]}'
COMPLETION = (
    b'{"id":"c","object":"chat.completion","created":1,"model":"fake","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
)
CHUNK = (
    b'data: {"id":"c","object":"chat.completion.chunk",'
    b'"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
)


@dataclass
class Request:
    line: bytes
    headers: dict[bytes, bytes]
    body: bytes


Handler = Callable[[Request, asyncio.StreamWriter], Awaitable[None]]


def reply(
    status: str, body: bytes, *extra: bytes, content_type: bytes = b"application/json"
) -> bytes:
    head = f"HTTP/1.1 {status}\r\ncontent-length: {len(body)}\r\n".encode()
    head += b"content-type: " + content_type + b"\r\n" + b"".join(h + b"\r\n" for h in extra)
    return head + b"\r\n" + body


def chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


async def ok(request: Request, writer: asyncio.StreamWriter) -> None:
    """A well-behaved worker: JSON, or a short SSE stream ending in [DONE]."""
    if b'"stream":true' in request.body.replace(b" ", b""):
        writer.write(SSE_HEAD + chunked(CHUNK) + chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    else:
        writer.write(reply("200 OK", COMPLETION))


async def endless_stream(request: Request, writer: asyncio.StreamWriter) -> None:
    """A stream that never idles and never ends (a chunk every 20 ms, for minutes)."""
    writer.write(SSE_HEAD)
    for _ in range(10_000):
        writer.write(chunked(CHUNK))
        await writer.drain()
        await asyncio.sleep(0.02)


async def gzip_when_asked(request: Request, writer: asyncio.StreamWriter) -> None:
    """Compresses whenever the client accepts gzip, like a server behind a compression layer."""
    if b"gzip" in request.headers.get(b"accept-encoding", b""):
        writer.write(reply("200 OK", gzip.compress(COMPLETION), b"content-encoding: gzip"))
    else:
        await ok(request, writer)


@dataclass
class FakeWorker:
    handler: Handler = ok
    port: int = field(default_factory=free_port)
    posts: int = 0
    seen: list[Request] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *rest = head[:-4].split(b"\r\n")
                headers = {}
                for raw in rest:
                    name, _, value = raw.partition(b":")
                    headers[name.strip().lower()] = value.strip()
                length = int(headers.get(b"content-length", b"0"))
                request = Request(line, headers, await reader.readexactly(length))
                if line.startswith(b"POST"):
                    self.posts += 1
                    self.seen.append(request)
                    await self.handler(request, writer)
                elif b"/v1/models" in line:
                    writer.write(reply("200 OK", MODELS))
                elif b"/metrics" in line:
                    writer.write(reply("200 OK", b"", content_type=b"text/plain"))
                else:
                    writer.write(reply("200 OK", b"{}"))
                await writer.drain()
        writer.close()


@contextlib.contextmanager
def fake_worker(handler: Handler = ok) -> Iterator[FakeWorker]:
    fake = FakeWorker(handler)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    stop: asyncio.Future[None] | None = None

    async def main() -> None:
        nonlocal stop
        stop = loop.create_future()
        server = await asyncio.start_server(fake._serve_one, "127.0.0.1", fake.port)
        started.set()
        async with server:
            await stop

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield fake
    finally:
        assert stop is not None
        loop.call_soon_threadsafe(stop.set_result, None)
        thread.join(10)
