"""Forwarding one request to a worker: retries before the first byte, SSE pass-through after,
client disconnects closing the upstream request, per-request metrics."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from service.capture.policy import Capture
from service.capture.record import RawCapture
from service.metrics import NO_POOL, GatewayMetrics, code_label
from service.reports import SpecStats, Usage, decode_speed, parse_usage, unwrap
from service.responses import StoreHook
from service.routing.fleet import LoadMark, Worker, WorkerFleet
from service.routing.upstream import Body, ConnectFailed, ConnectionPool, Target, UpstreamIOError
from service.routing.upstream import Response as UpstreamResponse
from service.settings import GatewaySettings
from service.sse import SseTap
from service.tenancy.limits import Headers, Ticket
from service.tracing import Attempt, RequestTrace
from service.watch import Draining, Watch, Watchdog
from wire.errors import (
    ApiError,
    NoHealthyWorker,
    Unavailable,
    UpstreamError,
    UpstreamTimeout,
    WorkersBusy,
    render,
)

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
    spec_details: bool = False  # the client asked SGLang's return_spec_tokens_details itself
    tenant: str | None = None  # the key's tenant, when the key file names tenants
    ticket: Ticket | None = None  # the tenant's admission: rate headers, the charge at the end
    responses: StoreHook | None = None  # /v1/responses: the gateway's store (service/responses.py)
    trace: RequestTrace | None = None  # with tracing on and the request sampled
    trace_headers: bytes = b""  # traced but not sampled: the traceparent the worker gets
    # The share of this caller's requests captured for drafter training (the tenant's
    # `capture:`; 1.0 without tenants); the pool's share multiplies it (service/capture/).
    capture_share: float = 0.0
    # The request's class (temperature band, prompt size): promotion compares pools within
    # it, ROUTING=fastest learns speeds by it (service/routing/promotion.py).
    klass: str = "sampled/short"

    @property
    def rate_headers(self) -> Headers:
        return self.ticket.headers if self.ticket is not None else ()


class UpstreamFailure(Exception):
    """An attempt failed before the client saw a byte: another worker may take it.
    `message` is for the client (no address, no library repr); `detail` for the log."""

    def __init__(self, kind: str, message: str, *, counts: bool = True, detail: str = "") -> None:
        super().__init__(message)
        self.kind, self.message, self.counts, self.detail = kind, message, counts, detail

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail or self.message}"


def classify(exc: BaseException) -> UpstreamFailure:
    detail = repr(exc)
    if isinstance(exc, ConnectFailed):
        return UpstreamFailure("connect", "cannot connect to the worker", detail=detail)
    if isinstance(exc, TimeoutError):
        return UpstreamFailure("timeout", "the worker did not answer in time", detail=detail)
    return UpstreamFailure("read", "the connection to the worker failed", detail=detail)


UPSTREAM_ERRORS = (UpstreamIOError, TimeoutError)


def status_failure(status: int) -> UpstreamFailure | None:
    """Worker statuses worth another worker: 503 is overload (not ill health), other 5xx."""
    if status == 503:
        return UpstreamFailure("overloaded", "the worker is at capacity", counts=False)
    if status >= 500:
        return UpstreamFailure(
            "status_5xx", f"the worker answered HTTP {status}", detail=f"HTTP {status}"
        )
    return None


def malformed(why: str) -> UpstreamFailure:
    return UpstreamFailure("malformed", "the worker's answer was malformed", detail=why)


def encoding_failure(response: UpstreamResponse) -> UpstreamFailure | None:
    """Workers are asked for `identity`; an encoded body would reach the client as garbage."""
    encoding = response.headers.get("content-encoding")
    if encoding is None or encoding.lower() == "identity":
        return None
    return malformed(f"content-encoding {encoding!r} although identity was asked for")


def finish(response: UpstreamResponse, complete: bool) -> None:
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
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


@dataclass
class Outcome:
    status: int = CLIENT_CLOSED  # the status sent to the client, once sent
    code: str | None = None  # the error code, when the gateway answered an error itself
    pool: str = NO_POOL  # the pool of the last worker tried
    attempt: Attempt | None = None  # the current attempt's spans, when traced
    # The client has the whole answer (a stream's [DONE] or terminal event was sent): a
    # client that leaves after that was answered, not cut off.
    delivered: bool = False
    load_mark: LoadMark | None = None  # its worker's load integral as the attempt began

    def begin(self, call: ProxyCall, number: int, worker: Worker) -> None:
        if call.trace is not None:
            self.attempt = call.trace.attempt(number, worker.url)

    def failed(self, failure: UpstreamFailure) -> None:
        if self.attempt is not None:
            self.attempt.fail(failure.kind, failure.message)

    def end_attempt(self) -> None:
        if self.attempt is not None:
            self.attempt.end()

    def first_byte(self, watch: Watch, idle_s: float, status: int, streamed: bool) -> None:
        """The worker answered: the watch switches to the idle limit (the attempt's
        first-byte span ends; an SSE stream's span begins)."""
        watch.idle_s = idle_s
        watch.marks += 2
        if self.attempt is not None:
            self.attempt.first_byte(status, streamed)

    def trace_headers(self, call: ProxyCall) -> bytes:
        """The worker's parent: this attempt (sampled), else the unsampled context, or none."""
        return self.attempt.headers() if self.attempt is not None else call.trace_headers


def pick(fleet: WorkerFleet, call: ProxyCall, tried: set[str]) -> Worker | None:
    """The fleet's choice; traced, under a routing span naming the pool and worker."""
    if call.trace is None:
        return fleet.pick(call.model, call.affinity_key, tried, call.klass)
    started = time.time_ns()
    worker = fleet.pick(call.model, call.affinity_key, tried, call.klass)
    call.trace.routed(started, worker)
    return worker


async def send_error(send: Send, error: ApiError, call: ProxyCall, outcome: Outcome) -> None:
    """The error as `render` writes it, straight onto the ASGI channel."""
    outcome.status, outcome.code = error.status_code, code_label(error.code, error.error_type)
    response = render(error, call.request_id)
    await send(
        {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": [*response.raw_headers, *call.rate_headers],
        }
    )
    await send({"type": "http.response.body", "body": response.body, "more_body": False})


def ids(call: ProxyCall, worker: Worker) -> tuple[tuple[bytes, bytes], ...]:
    """X-Request-Id, X-DFlash-Pool: which pool answered (a canary's answers can be told
    apart, though they are the same tokens), and the tenant's x-ratelimit-* headers."""
    return (b"x-request-id", call.request_id.encode()), worker.pool_header, *call.rate_headers


def attempt_watch(watchdog: Watchdog, settings: GatewaySettings, deadline: float) -> Watch:
    """The attempt's deadlines: nothing from the worker for first_byte_timeout_s, or the
    total deadline; `got_first_byte` then switches to the idle limit."""
    return watchdog.add(None, settings.first_byte_timeout_s, deadline)


def watchdog_tick(settings: GatewaySettings) -> float:
    """How often the watchdog looks: a deadline is noticed at most a quarter of the shortest
    one late, and at most 1 s late."""
    shortest = min(
        settings.first_byte_timeout_s, settings.idle_stream_timeout_s, settings.request_timeout_s
    )
    return min(1.0, shortest / 4)


class Proxy:
    """Runs attempts on workers from the pool until one answers or retries run out."""

    def __init__(
        self,
        settings: GatewaySettings,
        fleet: WorkerFleet,
        upstream: ConnectionPool,
        metrics: GatewayMetrics,
        capture: Capture | None = None,
    ) -> None:
        self.settings, self.fleet, self.upstream, self.metrics = settings, fleet, upstream, metrics
        self.capture = capture  # traffic capture (service/capture/), when on
        self.watchdog = Watchdog(watchdog_tick(settings))
        self.refusing = False  # draining: new requests get 503 + Retry-After
        self.in_flight = 0
        self._serial = itertools.count()
        self._targets: dict[str, Target] = {}  # worker URLs, parsed once

    def response(self, call: ProxyCall) -> ProxyResponse:
        return ProxyResponse(self, call)

    def cut_streams(self) -> int:
        """End every open upstream body (the drain's last step): streams get an in-band
        error and `[DONE]`. Returns how many were cut."""
        return self.watchdog.cut_all()

    async def run(self, call: ProxyCall, send: Send, outcome: Outcome) -> None:
        if self.refusing:
            error = draining(self.settings)
            error.headers["Connection"] = "close"  # the listener closes soon: reconnect
            await send_error(send, error, call, outcome)
            return
        self.in_flight += 1
        try:
            await self._attempts(call, send, outcome)
        finally:
            self.in_flight -= 1

    async def _attempts(self, call: ProxyCall, send: Send, outcome: Outcome) -> None:
        serial = next(self._serial)
        tried: set[str] = set()
        last: UpstreamFailure | None = None
        deadline = asyncio.get_running_loop().time() + self.settings.request_timeout_s
        for attempt in range(self.settings.max_retries + 1):
            worker = pick(self.fleet, call, tried)
            if worker is None:
                break
            if attempt:
                self.metrics.child(self.metrics.retries, call.label).inc()
            tried.add(worker.url)
            outcome.load_mark = worker.admit(call.klass)
            outcome.pool = worker.pool
            in_flight = self.metrics.child(self.metrics.in_flight, call.label, worker.pool)
            in_flight.inc()
            outcome.begin(call, attempt + 1, worker)
            try:
                attempt_fn = self._stream if call.stream else self._unary
                await attempt_fn(worker, call, send, outcome, deadline)
                return
            except UpstreamFailure as failure:
                log.warning(
                    "request %s: worker %s failed: %s", call.request_id, worker.url, failure
                )
                self.fleet.report_failure(worker, failure.kind, serial, counts=failure.counts)
                last = failure
                outcome.failed(failure)
            except Draining:
                await send_error(send, draining(self.settings), call, outcome)
                return
            finally:
                worker.release(call.klass)
                in_flight.dec()
                outcome.end_attempt()
        await send_error(send, final_error(last, self.settings), call, outcome)

    async def _post(
        self, worker: Worker, call: ProxyCall, watch: Watch, outcome: Outcome
    ) -> UpstreamResponse:
        """Send the request; the watch follows the connection it goes out on (its first-byte
        deadline, then the body's). The connection pool adds Accept-Encoding: identity and the
        worker key (app.worker_headers)."""
        target = self._targets.get(worker.url)
        if target is None:
            target = self._targets[worker.url] = Target.of(worker.url)
        body = worker.wire.request_body(call.body)
        path, extra = call.endpoint.encode(), outcome.trace_headers(call)
        return await self.upstream.post(target, path, body, call.request_id, watch.follow, extra)

    async def _unary(
        self, worker: Worker, call: ProxyCall, send: Send, outcome: Outcome, deadline: float
    ) -> None:
        response: UpstreamResponse | None = None
        complete = False
        watch = attempt_watch(self.watchdog, self.settings, deadline)
        try:
            response = await self._post(worker, call, watch, outcome)
            outcome.first_byte(watch, self.settings.idle_stream_timeout_s, response.status, False)
            body = await response.content.read()
            complete = True
        except UPSTREAM_ERRORS as exc:
            raise classify(exc) from None
        finally:
            self.watchdog.discard(watch)
            if response is not None:
                finish(response, complete)
        failure = status_failure(response.status) or encoding_failure(response)
        if failure is not None:
            raise failure
        parsed: Any = None
        if 200 <= response.status < 300:
            try:
                parsed = json.loads(body)
            except ValueError:
                raise malformed(f"HTTP {response.status} with a body that is not JSON") from None
            if not isinstance(parsed, dict):
                raise malformed(f"HTTP {response.status} with a JSON body that is not an object")
        self.fleet.report_success(worker)
        if parsed is not None:
            usage = parse_usage(parsed)
            self.metrics.observe_usage(call.label, worker.pool, usage, call.tenant)
            stats = worker.wire.spec_stats(parsed, usage)
            self.metrics.observe_spec(call.label, worker.pool, stats)
            if self.capture is not None and capturing(self.capture, call, worker):
                capture_reply(self.capture, call, worker, body, usage, stats, stream=False)
            learn(self.fleet, call, worker, decode_speed(parsed), stats, outcome.load_mark)
            if call.trace is not None:
                call.trace.replied(parsed, usage, stats)
            body = worker.wire.strip(body, parsed, call.spec_details)
            if call.responses is not None:  # stored before the client has the answer
                parsed = call.responses.patch(json.loads(body))
                await call.responses.keep(parsed)
                body = json.dumps(parsed, separators=(",", ":")).encode()
            if call.ticket is not None:  # charged before the client has the answer
                await call.ticket.settle(usage)
        else:
            body = worker.wire.error_body(body)
        outcome.status = response.status
        content_type = response.headers.get("content-type", "application/json").encode()
        await send_body(
            send, response.status, body, [(b"content-type", content_type), *ids(call, worker)]
        )

    async def _stream(
        self, worker: Worker, call: ProxyCall, send: Send, outcome: Outcome, deadline: float
    ) -> None:
        response: UpstreamResponse | None = None
        complete = False
        watch = attempt_watch(self.watchdog, self.settings, deadline)
        try:
            first: bytes | None = None
            try:
                response = await self._post(worker, call, watch, outcome)
                if response.status == 200:
                    failure = encoding_failure(response) or not_sse(response)
                    if failure is not None:
                        raise failure
                    first = await response.content.readany()
                    outcome.first_byte(watch, self.settings.idle_stream_timeout_s, 200, True)
                else:
                    idle_s = self.settings.idle_stream_timeout_s
                    outcome.first_byte(watch, idle_s, response.status, False)
                    body = await response.content.read()
                    complete = True
            except UPSTREAM_ERRORS as exc:
                raise classify(exc) from None
            if first is None:  # a non-200 answer: retry on 5xx, pass a 4xx through
                failure = status_failure(response.status) or encoding_failure(response)
                if failure is not None:
                    raise failure
                self.fleet.report_success(worker)
                outcome.status = response.status
                content_type = response.headers.get("content-type", "application/json").encode()
                headers = [(b"content-type", content_type), *ids(call, worker)]
                await send_body(send, response.status, worker.wire.error_body(body), headers)
                return
            if not first:
                raise UpstreamFailure("read", "the worker closed the stream at once")
            complete = await self._relay(
                worker, call, send, outcome, watch, response.content, first
            )
        finally:
            self.watchdog.discard(watch)
            if response is not None:
                finish(response, complete)

    async def _relay(
        self,
        worker: Worker,
        call: ProxyCall,
        send: Send,
        outcome: Outcome,
        watch: Watch,
        reader: Body,
        data: bytes,
    ) -> bool:
        """From the first byte on: pass events through; a failure ends the stream in-band.
        True when the upstream stream ended cleanly."""
        hook = call.responses
        tap = tap_for(call, worker, record_limit(self.capture, call, worker))
        outcome.status = 200
        headers = [*SSE_HEADERS, *ids(call, worker)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        failure: UpstreamFailure | None = None
        drained = False
        try:
            while True:
                out = tap.feed(data)
                if out:
                    if call.ticket is not None and tap.done and not call.ticket.settled:
                        await call.ticket.settle(parse_usage(tap.final))  # before [DONE]
                    if hook is not None and tap.done and not hook.kept:
                        await hook.keep(unwrap(tap.final))
                    watch.marks += 1  # odd: writing to the client, not waiting on the worker
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                    watch.marks += 1
                    outcome.delivered = tap.done
                data = await reader.readany()
                if not data:
                    break
        except UPSTREAM_ERRORS as exc:
            failure = classify(exc)
        except Draining:
            drained = True
        except asyncio.CancelledError:
            # The client read [DONE] and left while the worker's stream was still ending:
            # the request succeeded, and its tokens count like any other.
            if outcome.delivered:
                self.fleet.report_success(worker)
                observe_stream(self.metrics, call, worker, tap, self.capture, self.fleet, outcome)
            raise
        if failure is None and not drained and not tap.done:
            failure = UpstreamFailure("truncated", "the worker ended the stream early")
        if failure is not None and not drained:
            log.warning(
                "request %s: stream from %s broke: %s", call.request_id, worker.url, failure
            )
            # A fresh serial: this request never failed on this worker before (a worker is
            # tried once per request), so it counts as one more distinct request.
            self.fleet.report_failure(
                worker, failure.kind, next(self._serial), counts=failure.counts
            )
            outcome.failed(failure)
        elif not drained:
            self.fleet.report_success(worker)
        # Counted before the last send, which a client that already left may interrupt.
        observe_stream(self.metrics, call, worker, tap, self.capture, self.fleet, outcome)
        tail = stream_tail(hook, tap, drained, failure)
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        return failure is None and not drained


def learn(
    fleet: WorkerFleet,
    call: ProxyCall,
    worker: Worker,
    speed: float | None,
    stats: list[SpecStats] | None,
    mark: LoadMark | None,
) -> None:
    """One served request's decode speed (tokens/s), for its pool's rollout (promotion) and
    for ROUTING=fastest's estimates at the load it ran at on its worker (since `mark`)."""
    if fleet.speeds is not None and speed is not None and mark is not None:
        ended_alone = worker.outstanding == 1  # this request only
        load, mixed = worker.ran_at(mark), worker.mixed_since(mark, call.klass)
        # Accepted draft tokens per drafting step: what drafting gains its rows, which a
        # class that does not draft here (plain pools report none) cannot lose.
        gain = stats[0].accepted_tokens / stats[0].steps if stats and stats[0].steps else None
        fleet.speeds.observe(worker.pool, call.klass, load, speed, ended_alone, mixed, gain)
    promotions = fleet.promotions
    if promotions is not None and promotions.rollouts:
        acceptance = stats[0].acceptance_length if stats else None
        promotions.observe(worker.pool, call.klass, speed, acceptance)


def capturing(capture: Capture | None, call: ProxyCall, worker: Worker) -> bool:
    """Whether this request is captured (service/capture/): decided once per attempt."""
    return capture is not None and capture.wants(call.capture_share, worker.pool)


def record_limit(capture: Capture | None, call: ProxyCall, worker: Worker) -> int:
    """How much of a stream its tap records for capture (0: not captured)."""
    if capture is None or not capturing(capture, call, worker):
        return 0
    return capture.writer.config.sample_bytes


def capture_stream(
    capture: Capture | None,
    tap: SseTap,
    call: ProxyCall,
    worker: Worker,
    usage: Usage | None,
    stats: list[SpecStats] | None,
) -> None:
    """A stream the tap recorded, once it ended whole ([DONE] or the terminal event)."""
    recorded = tap.recorded
    if capture is not None and recorded is not None and tap.done and not tap.errored:
        capture_reply(capture, call, worker, recorded, usage, stats, stream=True)


def capture_reply(
    capture: Capture,
    call: ProxyCall,
    worker: Worker,
    reply: bytes,
    usage: Usage | None,
    stats: list[SpecStats] | None,
    *,
    stream: bool,
) -> None:
    """The request and the worker's reply, handed to the capture writer unparsed, with the
    usage and acceptance the proxy has already read from it."""
    capture.offer(
        RawCapture(
            endpoint=call.endpoint,
            request_body=call.body,
            reply=reply,
            stream=stream,
            model=call.label,
            pool=worker.pool,
            tenant=call.tenant,
            request_id=call.request_id,
            time=time.time(),
            usage=usage,
            acceptance_length=stats[0].acceptance_length if stats else None,
        )
    )


def stream_tail(
    hook: StoreHook | None, tap: SseTap, drained: bool, failure: UpstreamFailure | None
) -> bytes:
    """What ends a relayed stream that broke: the in-band error (a Responses stream's own
    terminal event), after which the client stops reading."""
    if drained:
        message = "The gateway is shutting down; the stream was cut. Retry the request."
        code = "draining"
        if hook is not None:
            return hook.failed(code, message, tap.events)
        return Unavailable(message, code=code).sse()
    if failure is None:
        return b""
    message = f"Upstream failure: {failure.message}."
    if hook is not None:
        return hook.failed(failure.kind, message, tap.events)
    return UpstreamError(message, code=failure.kind).sse()


def draining(settings: GatewaySettings) -> Unavailable:
    return Unavailable(
        "The gateway is shutting down; retry the request.",
        code="draining",
        retry_after=settings.retry_after_s,
    )


def final_error(last: UpstreamFailure | None, settings: GatewaySettings) -> ApiError:
    """What the client gets when no attempt succeeded; `last` is the last attempt's failure."""
    retry_after = {"Retry-After": str(settings.retry_after_s)}
    if last is None:
        return NoHealthyWorker("No healthy worker is available.", headers=retry_after)
    if last.kind == "overloaded" or last.kind == "pool":
        return WorkersBusy("Every worker is at capacity; retry later.", headers=retry_after)
    if last.kind == "timeout":
        return UpstreamTimeout(f"Upstream timeout: {last.message}.")
    return UpstreamError(f"Upstream failure: {last.message}.")


def tap_for(call: ProxyCall, worker: Worker, record_limit: int = 0) -> SseTap:
    return SseTap(
        strip_usage_chunk=not call.wants_usage,
        wire=worker.wire,
        keep_extra=call.spec_details,
        rewrite=call.responses.patch_event if call.responses is not None else None,
        collect_finish_reasons=call.trace is not None,
        record_limit=record_limit,
    )


def observe_stream(
    metrics: GatewayMetrics,
    call: ProxyCall,
    worker: Worker,
    tap: SseTap,
    capture: Capture | None = None,
    fleet: WorkerFleet | None = None,
    outcome: Outcome | None = None,
) -> None:
    """A relayed stream's usage, speculation summary, TTFT and TPOT; its capture, when its tap
    recorded it and it ended whole; its speed for its pool's rollout and, at the load it ran
    at (the attempt's `outcome`), for ROUTING=fastest."""
    end = time.perf_counter()
    pool, final = worker.pool, tap.final
    usage = parse_usage(final)
    metrics.observe_usage(call.label, pool, usage, call.tenant)
    spec = tap.spec_event if worker.wire.spec_marker else final
    stats = worker.wire.spec_stats(spec, usage) if spec is not None else None
    if stats is not None:
        metrics.observe_spec(call.label, pool, stats)
    capture_stream(capture, tap, call, worker, usage, stats)
    exemplar = None
    if call.trace is not None:
        call.trace.finish_reasons.extend(tap.finish_reasons or ())
        response = unwrap(final)  # a Responses stream's final object, else the chunk
        call.trace.outcome(usage, stats, response if isinstance(response, dict) else None)
        exemplar = call.trace.exemplar()
    first = tap.first_token_at
    # The gateway's own measure of the stream's decode speed (alike for every engine); the
    # worker's when the stream gives none (one token, several choices).
    speed = None
    if first is not None:
        metrics.child(metrics.ttft, call.label, pool).observe(first - call.started, exemplar)
    tokens = usage.completion_tokens if usage is not None else 0
    if first is not None and call.single_choice and tokens > 1:
        tpot = (end - first) / (tokens - 1)
        metrics.child(metrics.tpot, call.label, pool).observe(tpot, exemplar)
        speed = 1.0 / tpot if tpot > 0 else None
    if fleet is not None and tap.done and not tap.errored:
        mark = outcome.load_mark if outcome is not None else None
        learn(fleet, call, worker, speed or decode_speed(final), stats, mark)


def not_sse(response: UpstreamResponse) -> UpstreamFailure | None:
    content_type = response.headers.get("content-type", "")
    if content_type.startswith("text/event-stream"):
        return None
    return malformed(f"a streaming answer of type {content_type!r}")


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
        task = asyncio.current_task()
        assert task is not None
        gone = Gone(task)
        watcher = asyncio.get_running_loop().create_task(gone.watch(receive))
        try:
            await self.proxy.run(call, send, outcome)
            complete = True
        except asyncio.CancelledError:
            if not gone.left or task.uncancel():  # cancelled by someone else as well
                raise
            complete = outcome.delivered  # left after the whole answer: a 200, not a 499
        finally:
            watcher.cancel()
            status = outcome.status if complete else CLIENT_CLOSED
            code = outcome.code if complete else None
            metrics.count_response(call.label, call.endpoint, status, code, outcome.pool)
            if call.tenant is not None:
                metrics.count_tenant(call.tenant, call.label, status)
            if call.ticket is not None:
                call.ticket.release()  # no charge reached it: give its lease back
            elapsed = time.perf_counter() - call.started
            duration = metrics.child(metrics.duration, call.label, outcome.pool, call.endpoint)
            trace = call.trace
            if trace is None:
                duration.observe(elapsed)
            else:
                trace.disconnected = not complete
                trace.status, trace.error_code = status, code
                duration.observe(elapsed, trace.exemplar())


class Gone:
    """Cancels the request's task when the client disconnects (uvicorn's send() to a closed
    connection returns quietly, so only receive() tells). A plain task, not an anyio task
    group: this runs once per request."""

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task, self.left = task, False

    async def watch(self, receive: Receive) -> None:
        while True:
            message: Message = await receive()
            if message["type"] == "http.disconnect":
                self.left = True
                self.task.cancel()
                return
