"""The HTTP plumbing shared by gateway and worker: body reading, JSON, SSE framing."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from starlette.requests import Request

from wire.errors import ClientClosedRequest, InvalidRequest, PayloadTooLarge
from wire.http import SSE_DONE, parse_json_object, read_body, sse_event


def _request(chunks: list[bytes], content_length: int | None = None) -> Request:
    headers = [] if content_length is None else [(b"content-length", str(content_length).encode())]
    pending = list(chunks)

    async def receive() -> dict[str, Any]:
        body = pending.pop(0) if pending else b""
        return {"type": "http.request", "body": body, "more_body": bool(pending)}

    return Request({"type": "http", "method": "POST", "headers": headers}, receive)


@pytest.mark.anyio
async def test_body_within_the_limit_is_read_whole() -> None:
    assert await read_body(_request([b"ab", b"cd"]), limit=4) == b"abcd"


@pytest.mark.anyio
@pytest.mark.parametrize(("chunks", "declared"), [([b"x"], 10), ([b"abc", b"de"], None)])
async def test_too_large_is_413_declared_or_not(chunks: list[bytes], declared: int | None) -> None:
    with pytest.raises(PayloadTooLarge):
        await read_body(_request(chunks, declared), limit=4)


@pytest.mark.anyio
async def test_a_client_that_leaves_mid_body_is_499() -> None:
    messages = [{"type": "http.request", "body": b'{"model":', "more_body": True}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    request = Request({"type": "http", "method": "POST", "headers": []}, receive)
    with pytest.raises(ClientClosedRequest):
        await read_body(request, limit=100)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"  ",
        b"{not json",
        b"[1]",
        b'"s"',
        b'{"a": NaN}',
        b'{"a": Infinity}',
        b"[" * 100_000 + b"]" * 100_000,
        b"\xff\xfe",
    ],
)
def test_anything_but_a_json_object_is_400(raw: bytes) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_json_object(raw)
    assert err.value.code == "invalid_json"


def test_a_json_object_parses() -> None:
    assert parse_json_object(b'{"a": [1, 2.5, null]}') == {"a": [1, 2.5, None]}


def test_sse_framing() -> None:
    event = sse_event({"a": 1, "b": "é"})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:]) == {"a": 1, "b": "é"}
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_serving_processes_freeze_the_startup_heap() -> None:
    """Run in a child: freezing would keep this test process's garbage forever."""
    code = (
        "import gc\n"
        "from wire.http import GC_YOUNG_THRESHOLD, tune_gc_for_serving\n"
        "keep = [[i] for i in range(1000)]\n"
        "tune_gc_for_serving()\n"
        "assert gc.get_threshold()[0] == GC_YOUNG_THRESHOLD, gc.get_threshold()\n"
        "assert gc.get_freeze_count() >= len(keep), gc.get_freeze_count()\n"
        "assert gc.collect() == 0  # nothing frozen is scanned or freed\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_uvicorn_server_internals_draining_relies_on_keep_their_shape() -> None:
    """DrainingServer overrides uvicorn.Server.capture_signals (a generator context manager:
    serve_all handles the signals) and serve(sockets), and reads started, should_exit,
    force_exit and Config.get_loop_factory (pyproject pins the versions read: 0.54)."""
    import inspect

    import uvicorn

    capture = inspect.unwrap(uvicorn.Server.capture_signals)
    assert inspect.isgeneratorfunction(capture)
    assert list(inspect.signature(capture).parameters) == ["self"]
    assert list(inspect.signature(uvicorn.Server.serve).parameters) == ["self", "sockets"]
    server = uvicorn.Server(uvicorn.Config(app=lambda *a: None, log_config=None))
    assert (server.started, server.should_exit, server.force_exit) == (False, False, False)
    assert callable(server.config.get_loop_factory)
