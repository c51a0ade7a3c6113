"""Forwarding one request to a worker: retries before the first byte, SSE pass-through after,
client disconnects closing the upstream request, per-request metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from service.errors import (
    ApiError,
    NoHealthyWorker,
    UpstreamError,
    UpstreamTimeout,
    WorkersBusy,
    render,
)
from service.metrics import GatewayMetrics, parse_usage
from service.pool import Worker, WorkerPool
from service.settings import GatewaySettings
from service.sse import SseTap

log = logging.getLogger("dflash.gateway.proxy")
CLIENT_CLOSED = 499  # status label of requests the client abandoned (nginx's convention)


@dataclass(frozen=True)
class ProxyCall:
    """Everything one proxied request needs, decided by the API layer."""

    endpoint: str  # "/v1/chat/completions" or "/v1/completions"
    body: bytes  # what goes upstream (the client's JSON; include_usage forced on streams)
    stream: bool
    wants_usage: bool  # the client itself asked for stream_options.include_usage
    model: str  # requested model, for routing
    label: str  # metrics label (bounded: a served model or "unknown")
    affinity_key: str | None
    request_id: str
    single_choice: bool  # n == 1: TPOT is meaningful
    started: float  # perf_counter at arrival


class UpstreamFailure(Exception):
    """An attempt failed before the client saw a byte: another worker may take it."""

    def __init__(self, kind: str, message: str, *, counts: bool = True) -> None:
        super().__init__(message)
        self.kind, self.message, self.counts = kind, message, counts


def classify(exc: BaseException) -> UpstreamFailure:
    # Order matters: aiohttp's connect timeout is also a TimeoutError.
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
        return UpstreamFailure("connect", f"cannot connect to the worker: {exc}")
    if isinstance(exc, TimeoutError):
        return UpstreamFailure("timeout", "the worker did not answer in time")
    return UpstreamFailure("read", f"the worker connection failed: {exc!r}")


UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError)


def status_failure(status: int) -> UpstreamFailure | None:
    """Worker statuses worth another worker: 503 is overload (not ill health), other 5xx."""
    if status == 503:
        return UpstreamFailure("overloaded", "the worker is at capacity", counts=False)
    if status >= 500:
        return UpstreamFailure("status_5xx", f"the worker answered HTTP {status}")
    return None


def finish(response: aiohttp.ClientResponse, complete: bool) -> None:
    """Reuse the connection after a complete response; otherwise close it, which is how the
    worker learns that the client left (it stops generating). Synchronous: safe when the
    request was cancelled."""
    if complete:
        response.release()
    else:
        response.close()


async def send_body(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Send, error: ApiError) -> None:
    """The error as `render` writes it, straight onto the ASGI channel."""
    response = render(error)
    await send(
        {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": response.raw_headers,
        }
    )
    await send({"type": "http.response.body", "body": response.body, "more_body": False})


@dataclass
class Outcome:
    status: int = CLIENT_CLOSED  # the status sent to the client, once sent


class Proxy:
    """Runs attempts on workers from the pool until one answers or retries run out."""

    def __init__(
        self,
        settings: GatewaySettings,
        pool: WorkerPool,
        session: aiohttp.ClientSession,
        metrics: GatewayMetrics,
    ) -> None:
        self.settings, self.pool, self.session, self.metrics = settings, pool, session, metrics

    def response(self, call: ProxyCall) -> ProxyResponse:
        return ProxyResponse(self, call)

    async def run(self, call: ProxyCall, send: Send, outcome: Outcome) -> None:
        tried: set[str] = set()
        last: UpstreamFailure | None = None
        for attempt in range(self.settings.max_retries + 1):
            worker = self.pool.pick(call.model, call.affinity_key, tried)
            if worker is None:
                break
            if attempt:
                self.metrics.retries.labels(call.label).inc()
            tried.add(worker.url)
            worker.outstanding += 1
            try:
                attempt_fn = self._stream if call.stream else self._unary
                await attempt_fn(worker, call, send, outcome)
                return
            except UpstreamFailure as failure:
                log.warning(
                    "request %s: worker %s failed: %s", call.request_id, worker.url, failure
                )
                self.pool.report_failure(worker, failure.kind, counts=failure.counts)
                last = failure
            finally:
                worker.outstanding -= 1
        error = self._final_error(last)
        outcome.status = error.status_code
        await send_error(send, error)

    def _final_error(self, last: UpstreamFailure | None) -> ApiError:
        retry_after = {"Retry-After": str(self.settings.retry_after_s)}
        if last is None:
            return NoHealthyWorker("No healthy worker is available.", headers=retry_after)
        if last.kind == "overloaded" or last.kind == "pool":
            return WorkersBusy("Every worker is at capacity; retry later.", headers=retry_after)
        if last.kind == "timeout":
            return UpstreamTimeout(f"Upstream timeout: {last.message}.")
        return UpstreamError(f"Upstream failure: {last.message}.")

    async def _post(self, worker: Worker, call: ProxyCall) -> aiohttp.ClientResponse:
        headers = {"content-type": "application/json", "x-request-id": call.request_id}
        return await self.session.post(worker.url + call.endpoint, data=call.body, headers=headers)

    async def _unary(self, worker: Worker, call: ProxyCall, send: Send, outcome: Outcome) -> None:
        response: aiohttp.ClientResponse | None = None
        complete = False
        try:
            async with asyncio.timeout(self.settings.request_timeout_s):
                response = await self._post(worker, call)
                body = await response.read()
                complete = True
        except UPSTREAM_ERRORS as exc:
            raise classify(exc) from None
        finally:
            if response is not None:
                finish(response, complete)
        failure = status_failure(response.status)
        if failure is not None:
            raise failure
        self.pool.report_success(worker)
        if response.status == 200:
            self._observe_body(call, body)
        outcome.status = response.status
        content_type = response.headers.get("content-type", "application/json").encode()
        await send_body(send, response.status, body, [(b"content-type", content_type)])

    def _observe_body(self, call: ProxyCall, body: bytes) -> None:
        try:
            parsed: Any = json.loads(body)
        except ValueError:
            return
        self.metrics.observe_usage(call.label, parse_usage(parsed))
        self.metrics.observe_spec(call.label, parsed)

    async def _stream(self, worker: Worker, call: ProxyCall, send: Send, outcome: Outcome) -> None:
        response: aiohttp.ClientResponse | None = None
        complete = False
        try:
            first: bytes | None = None
            try:
                async with asyncio.timeout(self.settings.first_byte_timeout_s):
                    response = await self._post(worker, call)
                    if response.status == 200:
                        first = await response.content.readany()
                    else:
                        body = await response.read()
                        complete = True
            except UPSTREAM_ERRORS as exc:
                raise classify(exc) from None
            if first is None:  # a non-200 answer: retry on 5xx, pass a 4xx through
                failure = status_failure(response.status)
                if failure is not None:
                    raise failure
                self.pool.report_success(worker)
                outcome.status = response.status
                content_type = response.headers.get("content-type", "application/json").encode()
                await send_body(send, response.status, body, [(b"content-type", content_type)])
                return
            if not first:
                raise UpstreamFailure("read", "the worker closed the stream at once")
            complete = await self._relay(worker, call, send, outcome, response.content, first)
        finally:
            if response is not None:
                finish(response, complete)

    async def _relay(
        self,
        worker: Worker,
        call: ProxyCall,
        send: Send,
        outcome: Outcome,
        content: aiohttp.StreamReader,
        data: bytes,
    ) -> bool:
        """From the first byte on: pass events through; a failure ends the stream in-band.
        True when the upstream stream ended cleanly."""
        tap = SseTap(strip_usage_chunk=not call.wants_usage)
        outcome.status = 200
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        failure: UpstreamFailure | None = None
        try:
            while True:
                out = tap.feed(data)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                async with asyncio.timeout(self.settings.idle_stream_timeout_s):
                    data = await content.readany()
                if not data:
                    break
        except UPSTREAM_ERRORS as exc:
            failure = classify(exc)
        if failure is None and not tap.done:
            failure = UpstreamFailure("truncated", "the worker ended the stream early")
        tail = b""
        if failure is not None:
            log.warning(
                "request %s: stream from %s broke: %s", call.request_id, worker.url, failure
            )
            self.pool.report_failure(worker, failure.kind, counts=failure.counts)
            tail = UpstreamError(f"Upstream failure: {failure.message}.", code=failure.kind).sse()
        else:
            self.pool.report_success(worker)
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        self._observe_stream(call, tap)
        return failure is None

    def _observe_stream(self, call: ProxyCall, tap: SseTap) -> None:
        end = time.perf_counter()
        usage = parse_usage(tap.final)
        self.metrics.observe_usage(call.label, usage)
        if tap.final is not None:
            self.metrics.observe_spec(call.label, tap.final)
        first = tap.first_token_at
        if first is None:
            return
        self.metrics.ttft.labels(call.label).observe(first - call.started)
        if usage is not None and call.single_choice and usage.completion_tokens > 1:
            tpot = (end - first) / (usage.completion_tokens - 1)
            self.metrics.tpot.labels(call.label).observe(tpot)


SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies in front must not buffer the stream either
]


class ProxyResponse(Response):
    """The ASGI response of a proxied request: it runs the attempts itself, so it can watch
    for the client leaving and cancel them (which closes the upstream connection)."""

    def __init__(self, proxy: Proxy, call: ProxyCall) -> None:
        super().__init__()
        self.proxy, self.call = proxy, call

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        metrics, call = self.proxy.metrics, self.call
        outcome = Outcome()
        complete = False
        metrics.in_flight.labels(call.label).inc()
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(watch_disconnect, receive, group.cancel_scope)
                await self.proxy.run(call, send, outcome)
                complete = True
                group.cancel_scope.cancel()
        finally:
            status = outcome.status if complete else CLIENT_CLOSED
            metrics.in_flight.labels(call.label).dec()
            metrics.requests.labels(call.label, call.endpoint, str(status)).inc()
            elapsed = time.perf_counter() - call.started
            metrics.duration.labels(call.label, call.endpoint).observe(elapsed)


async def watch_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return
