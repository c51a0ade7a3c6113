"""HTTP plumbing shared by the gateway and the embedded worker (torch-free, so the gateway
image needs no torch): reading a JSON body with a size and depth limit, SSE framing, and a
uvicorn server that drains on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import math
import re
import signal
import socket
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from typing import Any

import uvicorn
from starlette.requests import ClientDisconnect, Request

from wire.errors import ClientClosedRequest, InvalidRequest, PayloadTooLarge

log = logging.getLogger("dflash.http")

SSE_DONE = b"data: [DONE]\n\n"
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def valid_request_id(given: str | None) -> str | None:
    """A client's X-Request-Id when it is safe to log and echo (short, plain characters),
    else None: the caller then makes its own."""
    return given if given is not None and _REQUEST_ID.fullmatch(given) else None


def package_version() -> str:
    """This project's version, as installed (gateway and worker report it on /version)."""
    try:
        return dist_version("dflash-serving")
    except PackageNotFoundError:  # a source tree that was not installed
        return "unknown"


def sse_event(payload: dict[str, Any]) -> bytes:
    """One Server-Sent Event carrying a JSON object."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _reject_constant(name: str) -> Any:
    raise InvalidRequest(f"{name} is not valid JSON.", code="invalid_json")


MAX_JSON_DEPTH = 64  # far beyond any OpenAI body; far below the parser's recursion limit
MAX_INT_DIGITS = 64  # far beyond int64: the schemas name the field of smaller out-of-range ones
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise InvalidRequest(
            f"A number in the body has more than {MAX_INT_DIGITS} digits.", code="invalid_json"
        )
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InvalidRequest("A number in the body is out of range.", code="invalid_json")
    return value


def _check_shape(data: Any, raw: bytes) -> None:
    """Nesting depth and lone surrogates, looked at only when the bytes say they might be
    there (a count of brackets, a \\uD8xx-\\uDFxx escape): the common body pays two scans
    at C speed. A lone surrogate decodes into a str that cannot be encoded again (the
    tokenizer, the response, a log line all fail on it)."""
    deep = raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
    surrogates = _SURROGATE_ESCAPE.search(raw) is not None
    if not deep and not surrogates:
        return
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if surrogates:
                _encodable(value)
            continue
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            raise InvalidRequest(
                f"The body is nested deeper than {MAX_JSON_DEPTH} levels.", code="invalid_json"
            )
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        stack.extend([(item, depth + 1) for item in items])


def _encodable(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(
            "The body holds a lone UTF-16 surrogate (\\uD800-\\uDFFF without its pair).",
            code="invalid_json",
        ) from None


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing more than `limit` bytes (413) without reading them all; a 499
    when the client leaves before it is whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"The request body is larger than {limit} bytes.")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"The request body is larger than {limit} bytes.")
            chunks.append(chunk)
    except ClientDisconnect:
        # The client left mid-body (or the server's body timeout answered 408 and closed):
        # a 499 like any client that leaves, not a 500 with a traceback.
        raise ClientClosedRequest("the client closed the connection during its body") from None
    return b"".join(chunks)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A JSON object from bytes; anything else (empty, malformed, NaN, too deep, not an
    object) is a 400."""
    if not raw.strip():
        raise InvalidRequest(
            "The request body is empty; expected a JSON object.", code="invalid_json"
        )
    try:
        data = json.loads(
            raw,
            parse_constant=_reject_constant,
            parse_int=_bounded_int,
            parse_float=_finite_float,
        )
    except (ValueError, RecursionError):
        raise InvalidRequest("The request body is not valid JSON.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    _check_shape(data, raw)
    return data


def client_request_id(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    """The client's X-Request-Id when it is one short token (echoed in headers and logs);
    None for a missing, repeated, long or odd one (the server then makes its own)."""
    found = [value for name, value in headers if name.lower() == b"x-request-id"]
    if len(found) != 1:
        return None
    return valid_request_id(found[0].decode("latin-1"))


async def read_json(request: Request, limit: int) -> tuple[bytes, dict[str, Any]]:
    """The raw body and the JSON object it holds."""
    raw = await read_body(request, limit)
    return raw, parse_json_object(raw)


class DrainingServer(uvicorn.Server):
    """uvicorn whose signals are handled by `serve_all`: on SIGTERM its `drain()` runs (by
    default: `on_drain()` at once, then `drain_delay_s`), and then it stops listening
    (in-flight requests then finish). `sock`: a listening socket of its own (a backlog,
    SO_REUSEPORT) instead of uvicorn binding host:port.

    Overrides uvicorn.Server's `capture_signals` and `serve(sockets)` and reads `started`,
    `should_exit`, `force_exit`: written against uvicorn 0.54's server.py, the range
    pyproject.toml pins; tests/wire/test_http.py fails if their shape changes."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_drain: Callable[[], None],
        drain_delay_s: float = 0.0,
        *,
        sock: socket.socket | None = None,
    ) -> None:
        super().__init__(config)
        self.on_drain = on_drain
        self.drain_delay_s = drain_delay_s
        self.socket = sock

    async def drain(self) -> None:
        self.on_drain()
        await asyncio.sleep(self.drain_delay_s)

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        if sockets is None and self.socket is not None:
            sockets = [self.socket]
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_all(
    servers: Sequence[DrainingServer], on_started: Callable[[], None] | None = None
) -> None:
    """Serve until SIGINT/SIGTERM; the first signal drains gracefully, a second forces exit.
    `on_started` runs once every server listens."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()

    def on_signal() -> None:
        if stopping.is_set():  # a second signal: stop now, whatever is in flight
            for server in servers:
                server.force_exit = True
                server.should_exit = True
        stopping.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)

    async def drain() -> None:
        await stopping.wait()
        log.info("draining")
        await asyncio.gather(*(server.drain() for server in servers))
        for server in servers:
            server.should_exit = True

    async def announce() -> None:
        # uvicorn offers a `started` flag, not an event: poll it.
        while not all(server.started for server in servers):  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        if on_started is not None:
            on_started()

    drainer, announcer = asyncio.create_task(drain()), asyncio.create_task(announce())
    try:
        await asyncio.gather(*(server.serve() for server in servers))
    finally:
        drainer.cancel()
        announcer.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


# Young objects between collections of the first generation (CPython's default: 700). A
# proxy allocates a few hundred objects per relayed request; at the default it collects
# thousands of times a second under a burst of streams.
GC_YOUNG_THRESHOLD = 50_000


def tune_gc_for_serving() -> None:
    """Once the app is built: collect, then freeze everything alive (modules, the app, its
    settings) out of the collector's reach, and collect young objects less often. Full
    collections then scan only what requests allocate, not the whole start-up heap: a
    stall of every stream on the loop at once, which a burst of new streams turns into
    tail latency."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def run_servers(
    servers: Sequence[DrainingServer], on_started: Callable[[], None] | None = None
) -> None:
    """Run on uvicorn's preferred loop (uvloop when installed) until drained."""
    with asyncio.Runner(loop_factory=servers[0].config.get_loop_factory()) as runner:
        runner.run(serve_all(servers, on_started))
