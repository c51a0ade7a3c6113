"""One request's trace at the gateway (docs/tracing.md): the server span and its children
(auth, tenant limits, routing, each upstream attempt with its first byte and its stream), the
GenAI attributes and DFlash's acceptance.

Built only when tracing is on (RequestContext creates a RequestTrace per request); with tracing
off the request path holds None and calls nothing here."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from service.reports import SpecStats, Usage

if TYPE_CHECKING:
    from wire.otel import Span, Tracing

# gen_ai.operation.name of each endpoint (the GenAI conventions' well-known values).
OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/responses": "chat",
}
CLIENT_CLOSED = 499


def operation(endpoint: str) -> str:
    return OPERATIONS.get(endpoint, endpoint.rsplit("/", 1)[-1] or "request")


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
        acceptance_length=1 + accepted / steps if steps else None,
        acceptance_rate=accepted / draft_total if draft_total else None,
    )


class RequestTrace:
    """The spans of one request. The server span continues the client's traceparent; the
    attempt span's context goes to the worker, whose spans then hang below it."""

    def __init__(
        self, tracing: Tracing, method: str, route: str, headers: list[tuple[bytes, bytes]]
    ) -> None:
        from wire.otel import SpanKind

        self.tracing = tracing
        self.server = tracing.start(
            f"{method} {route}",
            tracing.extract(headers),
            SpanKind.SERVER,
            {"http.request.method": method, "http.route": route},
        )
        self.status: int | None = None
        self.error_code: str | None = None
        self.disconnected = False
        self.finish_reasons: list[str] = []

    def headers_for(self, span: Span) -> bytes:
        """traceparent/tracestate header lines naming `span` as the worker's parent."""
        carrier = self.tracing.inject(span)
        return b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in carrier.items())

    def child(
        self, name: str, attributes: dict[str, Any] | None = None, parent: Span | None = None
    ) -> Span:
        return self.tracing.start(name, parent or self.server, attributes=attributes)

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
        self.server.set_attributes(attributes)

    def replied(self, body: dict[str, Any], usage: Usage | None, stats: list[SpecStats]) -> None:
        """A whole (non-streamed) answer: its choices' finish reasons, usage, acceptance."""
        for choice in body.get("choices") or ():
            reason = choice.get("finish_reason") if isinstance(choice, dict) else None
            if isinstance(reason, str):
                self.finish_reasons.append(reason)
        self.outcome(usage, stats, body.get("model"))

    def exemplar(self) -> dict[str, str]:
        """The exemplar of the request's latency observations (OpenMetrics `trace_id`)."""
        return {"trace_id": format(self.server.get_span_context().trace_id, "032x")}

    def outcome(
        self, usage: Usage | None, stats: list[SpecStats] | None, response_model: Any
    ) -> None:
        """What the worker reported: usage, finish reasons, the request's acceptance."""
        spec = summed(stats) if stats else None
        attributes: dict[str, Any] = {}
        if isinstance(response_model, str):
            attributes["gen_ai.response.model"] = response_model
        if usage is not None:
            attributes["gen_ai.usage.input_tokens"] = usage.prompt_tokens
            attributes["gen_ai.usage.output_tokens"] = usage.completion_tokens
        if self.finish_reasons:
            attributes["gen_ai.response.finish_reasons"] = list(self.finish_reasons)
        if spec is not None:
            attributes["dflash.spec.steps"] = spec.steps
            attributes["dflash.spec.accepted_tokens"] = spec.accepted_tokens
            if spec.draft_tokens is not None:
                attributes["dflash.spec.draft_tokens"] = spec.draft_tokens
            if spec.acceptance_length is not None:
                attributes["dflash.spec.mean_acceptance_length"] = spec.acceptance_length
            if spec.acceptance_rate is not None:
                attributes["dflash.spec.draft_acceptance_rate"] = spec.acceptance_rate
        self.server.set_attributes(attributes)

    def refused(self, span: Span, status: int, code: str, message: str) -> None:
        """A refusal at this step (401, 429, 4xx): the step's span says so, and why."""
        from wire.otel import Status, StatusCode

        span.set_attribute("http.response.status_code", status)
        span.set_attribute("error.type", code)
        span.add_event("refused", {"http.response.status_code": status, "error.type": code})
        span.set_status(Status(StatusCode.ERROR, message))

    def failed(self, span: Span, kind: str, message: str) -> None:
        """An upstream failure on this span: recorded as an event, the span in error."""
        from wire.otel import Status, StatusCode

        span.set_attribute("error.type", kind)
        span.add_event("upstream_failure", {"error.type": kind, "message": message})
        span.set_status(Status(StatusCode.ERROR, message))

    def routed(self, span: Span, worker: Any) -> None:
        """The routing decision: the pool and worker picked (never a key), or none."""
        if worker is None:
            span.add_event("no_worker")
        else:
            span.set_attributes({"dflash.pool": worker.pool, "dflash.worker": worker.label})
        span.end()

    def attempt(self, number: int, worker_label: str, url: str, pool: str) -> Attempt:
        from wire.otel import SpanKind

        span = self.tracing.start(
            f"attempt {number}",
            self.server,
            SpanKind.CLIENT,
            {
                "dflash.attempt": number,
                "dflash.worker": worker_label,
                "dflash.pool": pool,
                "server.address": url,
            },
        )
        return Attempt(self, span)

    def end(self) -> None:
        """The server span's status: a 4xx or 5xx the client got, or the client leaving."""
        from wire.otel import Status, StatusCode

        status = CLIENT_CLOSED if self.disconnected or self.status is None else self.status
        self.server.set_attribute("http.response.status_code", status)
        if status == CLIENT_CLOSED:
            self.server.add_event("client_disconnected")
            self.server.set_status(Status(StatusCode.ERROR, "the client closed the connection"))
        elif status >= 400:
            self.server.set_attribute("error.type", self.error_code or str(status))
            self.server.set_status(Status(StatusCode.ERROR, self.error_code or str(status)))
        self.server.end()


class Attempt:
    """One upstream attempt: its span (the worker's parent) and the first-byte and stream
    spans below it."""

    def __init__(self, trace: RequestTrace, span: Span) -> None:
        self.trace, self.span = trace, span
        self.waiting = trace.child("first_byte", parent=span)
        self.streaming: Span | None = None

    def headers(self) -> bytes:
        return self.trace.headers_for(self.span)

    def first_byte(self, status: int) -> None:
        self.span.set_attribute("http.response.status_code", status)
        self.waiting.end()
        self.streaming = self.trace.child("stream", parent=self.span)

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
