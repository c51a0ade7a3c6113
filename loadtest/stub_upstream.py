"""A fast stub of a worker, for the gateway benchmark only (never the thing under test).

Raw asyncio HTTP/1.1 with keep-alive, so that the upstream costs almost nothing and the
numbers show the gateway. It serves /health, /metrics, /v1/models and POST
/v1/chat/completions: JSON, or SSE with `events` chunks `gap_ms` apart (a request
may override it with an extra field `bench_gap_ms`), each carrying the
monotonic send time (`"t"`, ns) so the client can measure per-event delivery latency.

    python -m loadtest.stub_upstream --port P --events 20 --gap-ms 50 [--reply-chars N]

With `--reply-chars N` a JSON reply's content is N characters of prose, a different passage
for each request (windows over the project's docs), so what depends on the text (traffic
capture's parsing and compression) costs what it costs on real answers; without it, the
content is `events` x's, the same bytes every time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import time
from pathlib import Path

GAP = re.compile(rb'"bench_gap_ms":([0-9.]+)')  # per-request override of --gap-ms
MODELS = b'{"object":"list","data":[{"id":"stub","object":"model","owned_by":"bench"}]}'
USAGE = (
    '"usage":{"prompt_tokens":8,"completion_tokens":%d,"total_tokens":%d},'
    '"metrics":{"time_to_first_token_ms":1.0,"speculative_decoding":{"mean_acceptance_length":'
    '3.0,"draft_acceptance_rate":0.5,"acceptance_histogram":[1,0,1],"num_spec_steps":2,'
    '"num_accepted_draft_tokens":2,"num_draft_tokens":4,"num_spec_tokens":2}}'
)


def response(status: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    head = f"HTTP/1.1 {status}\r\ncontent-length: {len(body)}\r\n".encode()
    return head + b"content-type: " + content_type + b"\r\n\r\n" + body


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def unary_body(events: int, text: str | None = None) -> bytes:
    """A chat completion of `events` tokens whose content is `text` (`events` x's if None)."""
    content = json.dumps("x" * events if text is None else text)
    usage = USAGE % (events, events + 8)
    return (
        '{"id":"c","object":"chat.completion","created":1,"model":"stub","choices":[{"index":0,'
        f'"message":{{"role":"assistant","content":{content}}},"finish_reason":"length"}}],'
        f"{usage}}}"
    ).encode()


# The passages of `--reply-chars`: the project's own prose (docs/*.md), joined.
CORPUS = Path(__file__).resolve().parent.parent / "docs"


class Passages:
    """Successive windows of `chars` characters over the corpus, each one new until the
    corpus is used up (about 400 KB: hundreds of requests), then again from the start."""

    def __init__(self, chars: int) -> None:
        self.chars = chars
        self._text = "\n".join(p.read_text() for p in sorted(CORPUS.glob("*.md")))
        self._at = 0

    def next(self) -> str:
        if self._at + self.chars > len(self._text):
            self._at = 0
        passage = self._text[self._at : self._at + self.chars]
        self._at += self.chars
        return passage


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """(request line, body) of the next request on the connection, None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    body = await reader.readexactly(length) if length else b""
    return head.split(b"\r\n", 1)[0], body


class Stub:
    def __init__(self, events: int, gap_ms: float, reply_chars: int = 0) -> None:
        self.events, self.gap = events, gap_ms / 1000.0
        self._unary = response("200 OK", unary_body(events))
        self._passages = Passages(reply_chars) if reply_chars > 0 else None

    def unary(self) -> bytes:
        if self._passages is None:
            return self._unary
        return response("200 OK", unary_body(self.events, self._passages.next()))

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while (request := await read_request(reader)) is not None:
                line, body = request
                compact = body.replace(b" ", b"")
                if line.startswith(b"POST") and b'"stream":true' in compact:
                    found = GAP.search(compact)
                    gap = float(found.group(1)) / 1000.0 if found else self.gap
                    await self.stream(writer, b'"include_usage":true' in compact, gap)
                elif line.startswith(b"POST"):
                    writer.write(self.unary())
                elif b"/v1/models" in line:
                    writer.write(response("200 OK", MODELS))
                elif b"/metrics" in line:
                    writer.write(
                        response("200 OK", b"vllm:num_requests_waiting 0\n", b"text/plain")
                    )
                else:
                    writer.write(response("200 OK", b"{}"))
                await writer.drain()
        writer.close()

    async def stream(self, writer: asyncio.StreamWriter, usage: bool, gap: float) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for i in range(self.events):
            if i and gap:
                await asyncio.sleep(gap)
            event = (
                '{"id":"c","object":"chat.completion.chunk","created":1,"model":"stub",'
                f'"t":{time.monotonic_ns()},"choices":[{{"index":0,"delta":{{"content":"x"}}}}]}}'
            )
            writer.write(chunk(b"data: " + event.encode() + b"\n\n"))
            await writer.drain()
        if usage:
            final = '{"id":"c","object":"chat.completion.chunk","model":"stub","choices":[],'
            final += USAGE % (self.events, self.events + 8) + "}"
            writer.write(chunk(b"data: " + final.encode() + b"\n\n"))
        writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()


async def serve(port: int, events: int, gap_ms: float, reply_chars: int = 0) -> None:
    stub = Stub(events, gap_ms, reply_chars)
    server = await asyncio.start_server(stub.handle, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stub_upstream")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--events", type=int, default=20)
    p.add_argument("--gap-ms", type=float, default=0.0)
    p.add_argument("--reply-chars", type=int, default=0, help="prose in each JSON reply")
    args = p.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.port, args.events, args.gap_ms, args.reply_chars))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
