"""Faults of a worker, reproduced by a fake one: every upstream deadline on both paths,
malformed answers, compression, what counts toward ejection, and what error messages say."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from service.routing.fleet import worker_id
from tests.service.conftest import Gateway, running_gateway, wait_until
from tests.service.fake_upstream import (
    CHUNK,
    COMPLETION,
    MODEL,
    SSE_HEAD,
    FakeWorker,
    Request,
    chunked,
    endless_stream,
    fake_worker,
    gzip_when_asked,
    ok,
    reply,
)

CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
STREAM = {**CHAT, "stream": True}
FAST = {"health_interval_s": 30.0, "eject_cooldown_s": 30.0}  # no active check mid-test


async def silent(request: Request, writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(3600)


async def half_body(request: Request, writer: asyncio.StreamWriter) -> None:
    whole = reply("200 OK", COMPLETION)
    writer.write(whole[: len(whole) - 10])
    await writer.drain()
    await asyncio.sleep(3600)


async def stalls_mid_stream(request: Request, writer: asyncio.StreamWriter) -> None:
    writer.write(SSE_HEAD + chunked(CHUNK))
    await writer.drain()
    await asyncio.sleep(3600)


async def html_200(request: Request, writer: asyncio.StreamWriter) -> None:
    writer.write(reply("200 OK", b"<html>oops</html>", content_type=b"text/html"))


async def always_gzip(request: Request, writer: asyncio.StreamWriter) -> None:
    import gzip

    writer.write(reply("200 OK", gzip.compress(COMPLETION), b"content-encoding: gzip"))


async def hangs_up(request: Request, writer: asyncio.StreamWriter) -> None:
    writer.transport.abort()


async def bad_request(request: Request, writer: asyncio.StreamWriter) -> None:
    body = b'{"error":{"message":"bad","type":"invalid_request_error","param":null,"code":null}}'
    writer.write(reply("400 Bad Request", body))


async def internal_error(request: Request, writer: asyncio.StreamWriter) -> None:
    writer.write(reply("500 Internal Server Error", b'{"error":{"message":"boom"}}'))


@pytest.fixture
def gw_over() -> Iterator[Any]:
    """gw_over(handler, **settings): a gateway over one fake worker."""
    import contextlib

    with contextlib.ExitStack() as stack:

        def make(handler: Any, **settings: Any) -> tuple[Gateway, FakeWorker]:
            fake = stack.enter_context(fake_worker(handler))
            gw = stack.enter_context(running_gateway(workers=[fake.url], **{**FAST, **settings}))
            return gw, fake

        yield make


def post(gw: Gateway, body: dict[str, Any], timeout: float = 20) -> httpx.Response:
    return httpx.post(gw.v1 + "/chat/completions", json=body, timeout=timeout)


def events(reply_: httpx.Response) -> list[str]:
    return [line for line in reply_.text.split("\n") if line.startswith("data: ")]


def test_non_streaming_request_obeys_the_first_byte_timeout(gw_over: Any) -> None:
    gw, _ = gw_over(silent, first_byte_timeout_s=0.3)
    started = time.monotonic()
    answer = post(gw, CHAT)
    assert answer.status_code == 504 and answer.json()["error"]["code"] == "upstream_timeout"
    assert time.monotonic() - started < 5


def test_streaming_request_obeys_the_first_byte_timeout(gw_over: Any) -> None:
    gw, _ = gw_over(silent, first_byte_timeout_s=0.3)
    started = time.monotonic()
    answer = post(gw, STREAM)
    assert answer.status_code == 504 and answer.json()["error"]["code"] == "upstream_timeout"
    assert time.monotonic() - started < 5


def test_non_streaming_body_obeys_the_idle_timeout(gw_over: Any) -> None:
    gw, _ = gw_over(half_body, idle_stream_timeout_s=0.3)
    started = time.monotonic()
    answer = post(gw, CHAT)
    assert answer.status_code == 504
    assert time.monotonic() - started < 5


def test_stream_idle_timeout_ends_in_band(gw_over: Any) -> None:
    gw, _ = gw_over(stalls_mid_stream, idle_stream_timeout_s=0.3)
    answer = post(gw, STREAM)
    assert answer.status_code == 200
    tail = events(answer)
    assert tail[-1] == "data: [DONE]"
    assert '"code":"timeout"' in tail[-2]
    assert gw.metric("dflash_upstream_errors_total", kind="timeout") == 1


def test_total_deadline_applies_to_a_stream_that_never_idles(gw_over: Any) -> None:
    gw, _ = gw_over(endless_stream, request_timeout_s=0.6, idle_stream_timeout_s=5)
    started = time.monotonic()
    answer = post(gw, STREAM)
    assert time.monotonic() - started < 5
    tail = events(answer)
    assert tail[-1] == "data: [DONE]" and '"code":"timeout"' in tail[-2]
    assert len(tail) > 3  # chunks flowed before the deadline


def test_total_deadline_applies_to_a_non_streaming_request(gw_over: Any) -> None:
    gw, _ = gw_over(half_body, request_timeout_s=0.4, idle_stream_timeout_s=60)
    started = time.monotonic()
    assert post(gw, CHAT).status_code == 504
    assert time.monotonic() - started < 5


def test_malformed_2xx_is_a_502_and_counts_as_a_failure(gw_over: Any) -> None:
    gw, _ = gw_over(html_200)
    answer = post(gw, CHAT)
    assert answer.status_code == 502
    assert answer.json()["error"]["type"] == "upstream_error"
    assert gw.metric("dflash_upstream_errors_total", kind="malformed") == 1
    (worker,) = gw.state.live().fleet.workers.values()
    assert worker.failures == 1


def test_a_streaming_answer_that_is_not_sse_is_malformed(gw_over: Any) -> None:
    gw, _ = gw_over(html_200)
    assert post(gw, STREAM).status_code == 502


def test_compression_is_not_requested(gw_over: Any) -> None:
    gw, fake = gw_over(gzip_when_asked)
    answer = post(gw, CHAT)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "hi"
    assert fake.seen[-1].headers[b"accept-encoding"] == b"identity"


def test_an_encoded_answer_nobody_asked_for_is_a_502_not_garbage(gw_over: Any) -> None:
    gw, _ = gw_over(always_gzip)
    answer = post(gw, CHAT)
    assert answer.status_code == 502 and answer.json()["error"]["type"] == "upstream_error"


def test_error_messages_name_no_address_or_library(gw_over: Any) -> None:
    gw, _ = gw_over(hangs_up)
    message = post(gw, CHAT).json()["error"]["message"]
    assert "127.0.0.1" not in message and "Error" not in message and "(" not in message
    assert message == "Upstream failure: the connection to the worker failed."


def test_a_dead_workers_connect_error_names_no_address() -> None:
    with fake_worker(ok) as fake:
        with running_gateway(workers=[fake.url], **FAST) as gw:
            assert post(gw, CHAT).status_code == 200
            fake_port = fake.port
        gone = f"http://127.0.0.1:{fake_port}"
    with running_gateway(workers=[gone], **FAST) as gw:
        fleet = gw.state.live().fleet
        for worker in fleet.workers.values():
            worker.healthy = True  # as if the last active check had passed
        fleet.invalidate()
        answer = post(gw, CHAT)
    assert answer.status_code == 502
    message = answer.json()["error"]["message"]
    assert str(fake_port) not in message and "Connect call" not in message


def test_a_workers_4xx_never_counts(gw_over: Any) -> None:
    gw, _ = gw_over(bad_request, eject_after_failures=2)
    for _ in range(5):
        assert post(gw, CHAT).status_code == 400
    (worker,) = gw.state.live().fleet.workers.values()
    assert worker.failures == 0 and worker.healthy


def test_the_only_worker_is_never_ejected(gw_over: Any) -> None:
    gw, fake = gw_over(internal_error, eject_after_failures=2)
    for _ in range(6):
        assert post(gw, CHAT).status_code == 502
    assert fake.posts == 6  # every request still reached it: no 503 no_healthy_worker
    assert gw.metric("dflash_worker_healthy") == 1


def test_failures_of_distinct_requests_eject_one_of_two() -> None:
    with (
        fake_worker(internal_error) as bad,
        fake_worker(ok) as good,
        running_gateway(workers=[bad.url, good.url], eject_after_failures=3, **FAST) as gw,
    ):
        for _ in range(12):
            assert post(gw, CHAT).status_code == 200  # retried onto the good one
        assert bad.posts == 3  # ejected after three distinct requests failed on it
        assert gw.metric("dflash_worker_healthy", worker=worker_id(bad.url)) == 0
        assert gw.metric("dflash_worker_healthy", worker=worker_id(good.url)) == 1


CREATED = (
    b'event: response.created\ndata: {"type":"response.created","sequence_number":0,'
    b'"response":{"id":"resp_1","object":"response","created_at":1,"status":"in_progress",'
    b'"model":"' + MODEL.encode() + b'","output":[],"parallel_tool_calls":false,'
    b'"tool_choice":"none","tools":[],"store":false,"usage":null,"error":null}}\n\n'
)
DELTA = (
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
    b'"sequence_number":1,"item_id":"msg_1","output_index":0,"content_index":0,'
    b'"delta":"x","logprobs":[]}\n\n'
)


async def responses_stall(request: Request, writer: asyncio.StreamWriter) -> None:
    writer.write(SSE_HEAD + chunked(CREATED) + chunked(DELTA))
    await writer.drain()
    await asyncio.sleep(3600)


def test_a_broken_responses_stream_ends_with_response_failed(gw_over: Any) -> None:
    """The Responses API's own terminal event, typed as the OpenAI SDK reads it, with the
    client's store fields, the sequence going on, and nothing stored."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    gw, _ = gw_over(responses_stall, idle_stream_timeout_s=0.3)
    body = {"model": MODEL, "input": "hi", "stream": True}
    answer = httpx.post(gw.v1 + "/responses", json=body, timeout=20)
    assert answer.status_code == 200
    data = [line.removeprefix("data: ") for line in events(answer)]
    adapter: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)
    typed = [adapter.validate_json(line) for line in data]
    assert [e.type for e in typed] == [
        "response.created",
        "response.output_text.delta",
        "response.failed",
    ]
    created, failed = typed[0], typed[-1]
    assert created.response.store is True  # type: ignore[union-attr]
    assert failed.response.id == "resp_1" and failed.response.status == "failed"  # type: ignore[union-attr]
    assert failed.response.error is not None  # type: ignore[union-attr]
    assert failed.sequence_number == 2
    missing = httpx.get(gw.v1 + "/responses/resp_1", timeout=5)
    assert missing.status_code == 404


USAGE_CHUNK = (
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8}}\n\n'
)
COMPLETED = (
    b'event: response.completed\ndata: {"type":"response.completed","sequence_number":2,'
    b'"response":{"id":"resp_1","object":"response","created_at":1,"status":"completed",'
    b'"model":"' + MODEL.encode() + b'","output":[],"parallel_tool_calls":false,'
    b'"tool_choice":"none","tools":[],"store":false,"error":null,'
    b'"usage":{"input_tokens":3,"output_tokens":5,"total_tokens":8}}}\n\n'
)
# A whole answer, then the end of the stream a while later: a chat stream ends with [DONE],
# a Responses stream with its terminal event.
WHOLE: dict[str, tuple[str, dict[str, Any], bytes, str]] = {
    "chat": (
        "/chat/completions",
        {**STREAM, "stream_options": {"include_usage": True}},
        CHUNK + USAGE_CHUNK + b"data: [DONE]\n\n",
        "data: [DONE]",
    ),
    "responses": (
        "/responses",
        {"model": MODEL, "input": "hi", "stream": True},
        CREATED + DELTA + COMPLETED,
        'data: {"type":"response.completed"',
    ),
}


@pytest.mark.parametrize("api", sorted(WHOLE))
def test_a_client_leaving_after_the_whole_answer_is_counted_as_answered(
    gw_over: Any, api: str
) -> None:
    """A client that read the end of its stream and left before the worker closed it got its
    whole answer: a 200 with its tokens counted, not a 499 with the tokens lost (seen in CI)."""
    path, body, answer_bytes, last = WHOLE[api]

    async def slow_to_close(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + chunked(answer_bytes))
        await writer.drain()
        await asyncio.sleep(1.5)
        writer.write(b"0\r\n\r\n")

    gw, _ = gw_over(slow_to_close)
    with httpx.stream("POST", gw.v1 + path, json=body, timeout=20) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith(last):
                break  # leaves with the worker's stream still open
    wait_until(lambda: gw.metric("dflash_requests_total", model=MODEL) >= 1, timeout=10)
    assert gw.metric("dflash_requests_total", model=MODEL, status="200") == 1
    assert gw.metric("dflash_completion_tokens_total", model=MODEL) == 5
    assert gw.metric("dflash_prompt_tokens_total", model=MODEL) == 3


SPEC_USAGE_CHUNK = (
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8},'
    b'"metrics":{"speculative_decoding":{"num_spec_steps":2,"num_accepted_draft_tokens":3,'
    b'"num_draft_tokens":6,"num_spec_tokens":3}}}\n\n'
)


def test_a_crlf_stream_split_across_reads_is_counted_and_passed_unchanged(gw_over: Any) -> None:
    """A worker (or a proxy before it) that ends SSE lines with CRLF, its writes splitting a
    CRLF and a blank line: the client gets the bytes as sent (less the usage chunk it did not
    ask for), and the usage and speculation reach /metrics."""
    stream = (CHUNK + SPEC_USAGE_CHUNK + b"data: [DONE]\n\n").replace(b"\n", b"\r\n")
    usage_end = stream.index(b"data: [DONE]")
    # cuts inside the usage chunk's CRLF CRLF, and inside the first chunk's
    cuts = [len(CHUNK) + 1, usage_end - 3, usage_end - 1]

    async def crlf_in_pieces(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD)
        for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True):
            writer.write(chunked(stream[a:b]))
            await writer.drain()
            await asyncio.sleep(0.05)  # each piece its own read at the gateway
        writer.write(b"0\r\n\r\n")

    gw, _ = gw_over(crlf_in_pieces)
    answer = httpx.post(gw.v1 + "/chat/completions", json=STREAM, timeout=20)
    assert answer.status_code == 200
    usage_start = stream.index(b"data: {", len(CHUNK))
    assert answer.content == stream[:usage_start] + stream[usage_end:]
    wait_until(lambda: gw.metric("dflash_requests_total", model=MODEL) >= 1, timeout=10)
    assert gw.metric("dflash_completion_tokens_total", model=MODEL) == 5
    assert gw.metric("dflash_spec_steps_total", model=MODEL) == 2
    assert gw.metric("dflash_spec_accepted_tokens_total", model=MODEL) == 3
