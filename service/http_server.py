"""The gateway's HTTP/1.1 server side beyond uvicorn's defaults: read deadlines for request
headers and bodies, and the listening socket (SO_REUSEPORT for several processes, a backlog
sized for bursts of new connections).

uvicorn bounds only the idle time between requests: a client dribbling its headers a byte a
second, or declaring a Content-Length it never sends, holds a connection and a descriptor for
as long as it likes. Here a header deadline runs from the connection's (or the request's)
first byte to the end of the headers, and a body deadline from there to the body's end; a
request that misses one gets a 408 with an OpenAI error body and the connection is closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from wire.errors import error_body

log = logging.getLogger("dflash.gateway.http")


def _timeout_response(message: str) -> bytes:
    body = json.dumps(
        error_body(message, "invalid_request_error", None, "request_timeout"),
        separators=(",", ":"),
    ).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


HEADERS_LATE = _timeout_response("The request headers were not received in time.")
BODY_LATE = _timeout_response("The request body was not received in time.")


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with header and body read deadlines.

    It overrides uvicorn's private hooks (connection_made/lost, on_message_begin,
    on_headers_complete, on_message_complete, on_response_complete) and reads `loop`,
    `transport`, `client` and `cycle.response_started`: written against uvicorn 0.54's
    httptools_impl.py, the range pyproject.toml pins; tests/service/test_http_server.py fails
    if their names or signatures change."""

    header_timeout_s = 10.0
    body_timeout_s = 30.0
    _read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout_s, HEADERS_LATE)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._read_timer is None:  # a keep-alive connection's next request
            self._arm(self.header_timeout_s, HEADERS_LATE)

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        self._arm(self.body_timeout_s, BODY_LATE)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Between requests uvicorn's keep-alive timeout applies; ours restarts with the
        # next request's first byte.
        self._disarm()

    def _arm(self, delay: float, response: bytes) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(delay, self._late, response)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _late(self, response: bytes) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or not cycle.response_started:
            self.transport.write(response)
        log.info("closing a connection from %s: %s", self.client, response.split(b"\r\n", 1)[0])
        self.transport.close()


def guarded_protocol(header_timeout_s: float, body_timeout_s: float) -> type[HttpToolsProtocol]:
    """A protocol class with these deadlines (uvicorn takes a class, not an instance)."""
    attrs: dict[str, Any] = {
        "header_timeout_s": header_timeout_s,
        "body_timeout_s": body_timeout_s,
    }
    return type("GatewayHttpProtocol", (GuardedHttpProtocol,), attrs)


def listening_socket(host: str, port: int, backlog: int, *, reuse_port: bool) -> socket.socket:
    """A bound, listening socket. With `reuse_port` several processes bind the same port and
    the kernel spreads new connections over them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    cap = _somaxconn()
    if cap is not None and cap < backlog:
        log.warning(
            "listen backlog %d is capped at %d by net.core.somaxconn: bursts of new "
            "connections beyond it wait for SYN retries",
            backlog,
            cap,
        )
    return sock


def _somaxconn() -> int | None:
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None
