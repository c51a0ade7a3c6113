"""One request's trace at the gateway (docs/tracing.md): the server span and its children
(admission: the key and the tenant's limits; routing; each upstream attempt with its first
byte and its stream), the GenAI attributes and DFlash's acceptance.

Built only when tracing is on (RequestContext creates a RequestTrace per request); with tracing
off the request path holds None and calls nothing here."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from service.reports import SpecStats, Usage
from wire.speculation import draft_acceptance_rate, mean_acceptance_length, spec_span_attributes
from wire.tracing import operation

if TYPE_CHECKING:
    from wire.otel import Span, Tracing

CLIENT_CLOSED = 499
# A Responses API answer's end, as a GenAI finish reason: `incomplete_details.reason` names
# why an incomplete one stopped (`max_output_tokens` is chat's `length`).
RESPONSE_FINISH = {"completed": "stop", "failed": "error"}
INCOMPLETE_FINISH = {"max_output_tokens": "length"}


def response_finish(response: dict[str, Any]) -> str | None:
    """The finish reason of a Responses API object, read from its status (None while it is
    not finished or for any other body)."""
    if response.get("object") != "response":
        return None
    status = response.get("status")
    if status == "incomplete":
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        return INCOMPLETE_FINISH.get(reason, reason) if isinstance(reason, str) else "incomplete"
    return RESPONSE_FINISH.get(status) if isinstance(status, str) else None


def summed(stats: list[SpecStats]) -> SpecStats:
    """One request's acceptance over its choices (one for n == 1)."""
    if len(stats) == 1:
        return stats[0]
    steps = sum(s.steps for s in stats)
    accepted = sum(s.accepted_tokens for s in stats)
    drafts = [s.draft_tokens for s in stats]
    draft_total = None if None in drafts else sum(d or 0 for d in drafts)
    return SpecStats(
        steps=steps,
        draft_tokens=draft_total,
        accepted_tokens=accepted,
        acceptance_length=mean_acceptance_length(accepted, steps),
        acceptance_rate=draft_acceptance_rate(accepted, draft_total) if draft_total else None,
    )


def begin_trace(
    tracing: Tracing, method: str, route: str, headers: list[tuple[bytes, bytes]]
) -> RequestTrace | bytes:
    """The request's trace if the sampler keeps it, else the `traceparent` header line the
    worker gets (the decision passed on; nothing else is built for such a request)."""
    name = f"{method} {route}"
    begun = tracing.begin(name, headers, {"http.request.method": method, "http.route": route})
    return begun if isinstance(begun, bytes) else RequestTrace(tracing, begun)


class RequestTrace:
    """The spans of one sampled request. The server span continues the client's traceparent;
    the attempt span's context goes to the worker, whose spans then hang below it. Children
    get their attributes when they start, and the server span gets the answer's attributes
    once, at its end (each SDK call validates what it is given: fewer calls, less CPU)."""

    def __init__(self, tracing: Tracing, server: Span) -> None:
        self.tracing, self.server = tracing, server
        self.context = tracing.context(server)
        self.status: int | None = None
        self.error_code: str | None = None
        self.disconnected = False
        self.finish_reasons: list[str] = []
        self.answer: dict[str, Any] = {}  # the request's and answer's attributes, set at the end
        # A tenant's key check (tenant, start and end ns) whose span waits for its limits.
        self.pending: tuple[str, int, int] | None = None
        self.trace_id = format(server.get_span_context().trace_id, "032x")

    def headers_for(self, span: Span) -> bytes:
        """traceparent/tracestate header lines naming `span` as the worker's parent."""
        carrier = self.tracing.inject(span)
        return b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in carrier.items())

    def child(
        self,
        name: str,
        attributes: dict[str, Any] | None = None,
        start_time: int | None = None,
    ) -> Span:
        return self.tracing.tracer.start_span(
            name, context=self.context, attributes=attributes, start_time=start_time
        )

    def authenticated(self, started: int, tenant: str | None, valid: bool) -> None:
        """The key check that began at `started` (ns): a 401, a key, or a tenant's key. Key
        and limits share one `admission` span (one span less to build and export): a
        tenant's span is made by `admission` when its limits are checked (the key check, a
        lookup, is long over), or by `end` from the check's own times if none followed."""
        if valid and tenant:
            self.pending = (tenant, started, time.time_ns())
            return
        span = self.child("admission", None, started)
        if not valid:
            self.refused(span, 401, "invalid_api_key", "no valid API key")
        span.end()

    def admission(self, tenant: str) -> Span:
        """The span of the tenant's limits check, starting now: its duration is the wait
        for the tenant's limits; the caller ends it (a refusal sets its status first)."""
        self.pending = None
        return self.child("admission", {"dflash.tenant": tenant})

    def request(self, endpoint: str, model: str, payload: dict[str, Any], request_id: str) -> None:
        """The GenAI request attributes, from the client's body (validated before)."""
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation(endpoint),
            "gen_ai.request.model": model,
            "dflash.request_id": request_id,
        }
        max_tokens = payload.get("max_completion_tokens", payload.get("max_tokens"))
        if max_tokens is None:
            max_tokens = payload.get("max_output_tokens")
        if isinstance(max_tokens, int):
            attributes["gen_ai.request.max_tokens"] = max_tokens
        temperature = payload.get("temperature")
        if isinstance(temperature, int | float) and not isinstance(temperature, bool):
            attributes["gen_ai.request.temperature"] = float(temperature)
        if isinstance(payload.get("stream"), bool):
            attributes["gen_ai.request.stream"] = payload["stream"]
        self.answer.update(attributes)

    def replied(self, body: dict[str, Any], usage: Usage | None, stats: list[SpecStats]) -> None:
        """A whole (non-streamed) answer: its choices' finish reasons, usage, acceptance."""
        for choice in body.get("choices") or ():
            reason = choice.get("finish_reason") if isinstance(choice, dict) else None
            if isinstance(reason, str):
                self.finish_reasons.append(reason)
        self.outcome(usage, stats, body)

    def exemplar(self) -> dict[str, str]:
        """The exemplar of the request's latency observations (OpenMetrics `trace_id`)."""
        return {"trace_id": self.trace_id}

    def outcome(
        self, usage: Usage | None, stats: list[SpecStats] | None, body: dict[str, Any] | None
    ) -> None:
        """What the worker reported: usage, finish reasons, the request's acceptance. `body`:
        the whole answer, a stream's final chunk, or a Responses stream's final object."""
        spec = summed(stats) if stats else None
        attributes: dict[str, Any] = {}
        body = body or {}
        if isinstance(body.get("model"), str):
            attributes["gen_ai.response.model"] = body["model"]
        finished = response_finish(body)
        if finished is not None:
            self.finish_reasons.append(finished)
        if usage is not None:
            attributes["gen_ai.usage.input_tokens"] = usage.prompt_tokens
            attributes["gen_ai.usage.output_tokens"] = usage.completion_tokens
        if self.finish_reasons:
            attributes["gen_ai.response.finish_reasons"] = tuple(self.finish_reasons)
        if spec is not None:
            # the engine's own mean where it reports one (TensorRT-LLM's tokens per step,
            # from which the steps were derived), else 1 + accepted / steps
            attributes.update(
                spec_span_attributes(
                    spec.steps, spec.accepted_tokens, spec.draft_tokens, spec.acceptance_length
                )
            )
        self.answer.update(attributes)

    def refused(self, span: Span, status: int, code: str, message: str) -> None:
        """A refusal at this step (401, 429, 4xx): the step's span says so, and why."""
        attributes = {"http.response.status_code": status, "error.type": code}
        self.tracing.fail(span, message, attributes, event="refused")

    def failed(self, span: Span, kind: str, message: str) -> None:
        """An upstream failure on this span: recorded as an event, the span in error."""
        attributes, details = {"error.type": kind}, {"message": message}
        self.tracing.fail(span, message, attributes, event="upstream_failure", details=details)

    def routed(self, started: int, worker: Any) -> None:
        """The routing decision that began at `started` (ns): the pool and worker picked
        (never a key), or none. Each fact sits on one span: the model asked for is the server
        span's, and the attempt that follows names only its number and the address it calls."""
        if worker is None:
            span = self.child("route", None, started)
            span.add_event("no_worker")
        else:
            attributes = {"dflash.pool": worker.pool, "dflash.worker": worker.label}
            span = self.child("route", attributes, started)
        span.end()

    def attempt(self, number: int, url: str) -> Attempt:
        """Attempt `number` to the worker at `url` (its pool and label: the route span's)."""
        attributes: dict[str, Any] = {"dflash.attempt": number, "server.address": url}
        span = self.tracing.start(f"attempt {number}", self.context, "client", attributes)
        return Attempt(self, span)

    def end(self) -> None:
        """The server span's status: a 4xx or 5xx the client got, or the client leaving."""
        if self.pending is not None:  # a tenant's key, and no limits checked after it
            tenant, started, ended = self.pending
            self.child("admission", {"dflash.tenant": tenant}, started).end(ended)
        status = CLIENT_CLOSED if self.disconnected or self.status is None else self.status
        answer = self.answer
        answer["http.response.status_code"] = status
        if status >= 400 and status != CLIENT_CLOSED:
            answer["error.type"] = self.error_code or str(status)
        self.server.set_attributes(answer)
        if status == CLIENT_CLOSED:
            message = "the client closed the connection"
            self.tracing.fail(self.server, message, event="client_disconnected")
        elif status >= 400:
            self.tracing.fail(self.server, answer["error.type"])
        self.server.end()


class Attempt:
    """One upstream attempt: its span (the worker's parent) and the first-byte and stream
    spans below it. Only a streamed answer has a stream span: a whole answer's body ends
    with its attempt span, which a second span would only repeat."""

    def __init__(self, trace: RequestTrace, span: Span) -> None:
        self.trace, self.span = trace, span
        tracer = trace.tracing.tracer
        self.context = trace.tracing.context(span)
        self.waiting = tracer.start_span("first_byte", context=self.context)
        self.streaming: Span | None = None

    def headers(self) -> bytes:
        return self.trace.headers_for(self.span)

    def first_byte(self, status: int, streamed: bool) -> None:
        self.span.set_attribute("http.response.status_code", status)
        self.waiting.end()
        if streamed:
            self.streaming = self.trace.tracing.tracer.start_span("stream", context=self.context)

    def fail(self, kind: str, message: str) -> None:
        self.trace.failed(self.span, kind, message)
        target = self.streaming or self.waiting
        if target.is_recording():
            self.trace.failed(target, kind, message)

    def end(self) -> None:
        end = time.time_ns()
        for span in (self.waiting, self.streaming, self.span):
            if span is not None and span.is_recording():
                span.end(end)
