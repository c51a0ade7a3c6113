"""Client-side read deadlines of the gateway process: slow headers, short bodies."""

from __future__ import annotations

import socket
import time

from tests.service.fake_upstream import fake_worker
from tests.service.gateway_process import gateway_process

DEADLINES = {"header_read_timeout_s": "0.5", "body_read_timeout_s": "0.5"}


def read_all(sock: socket.socket, within_s: float) -> bytes:
    sock.settimeout(within_s)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_slow_headers_get_408_and_the_connection_closes() -> None:
    with fake_worker() as fake, gateway_process(fake.url, **DEADLINES) as (base, _):
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            started = time.monotonic()
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")  # then nothing
            answer = read_all(sock, 10)
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert b'"code":"request_timeout"' in answer
        assert time.monotonic() - started < 5
        with socket.create_connection(("127.0.0.1", port)) as idle:  # not even one byte
            assert read_all(idle, 10).startswith(b"HTTP/1.1 408 ")


def test_a_body_shorter_than_its_length_gets_408() -> None:
    with fake_worker() as fake, gateway_process(fake.url, **DEADLINES) as (base, _):
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            started = time.monotonic()
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b'content-type: application/json\r\ncontent-length: 100\r\n\r\n{"model":'
            )
            answer = read_all(sock, 10)
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert time.monotonic() - started < 5
        assert fake.posts == 0


def test_keep_alive_requests_each_get_their_own_header_deadline() -> None:
    with fake_worker() as fake, gateway_process(fake.url, **DEADLINES) as (base, _):
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            for _ in range(3):  # 3 x 0.3 s > one deadline: each request restarts it
                time.sleep(0.3)
                sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
                sock.settimeout(5)
                answer = b""
                while not answer.endswith(b'{"status":"ok"}'):
                    answer += sock.recv(65536)
                assert answer.startswith(b"HTTP/1.1 200 ")


# The uvicorn internals GuardedHttpProtocol overrides or reads (pyproject pins the versions
# read: 0.54): a release that renames or reshapes one fails here, not as silently lost
# deadlines in production.
PROTOCOL_HOOKS = {
    "connection_made": ["self", "transport"],
    "connection_lost": ["self", "exc"],
    "on_message_begin": ["self"],
    "on_headers_complete": ["self"],
    "on_message_complete": ["self"],
    "on_response_complete": ["self"],
}


def test_the_uvicorn_internals_the_deadlines_hook_keep_their_shape() -> None:
    import asyncio
    import inspect

    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
    from uvicorn.server import ServerState

    for name, params in PROTOCOL_HOOKS.items():
        method = getattr(HttpToolsProtocol, name)
        assert list(inspect.signature(method).parameters) == params, name
    # the attributes _late reads: the loop, the transport, the client and the request cycle
    assert "self.response_started" in inspect.getsource(RequestResponseCycle.__init__)

    async def app(scope: object, receive: object, send: object) -> None:
        return None

    loop = asyncio.new_event_loop()
    try:
        config = uvicorn.Config(app, http="httptools", log_config=None)
        protocol = HttpToolsProtocol(config, ServerState(), {}, _loop=loop)
        assert protocol.loop is loop and protocol.cycle is None
        left, right = socket.socketpair()
        with left, right:
            transport = loop.run_until_complete(
                loop.connect_accepted_socket(lambda: protocol, left)
            )[0]
            assert protocol.transport is transport and hasattr(protocol, "client")
            transport.close()
            loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
