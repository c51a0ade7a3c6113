"""OpenTelemetry's SDK, set up from TracingSettings: the process's own TracerProvider (never
the global one), OTLP export over gRPC or HTTP, W3C trace context in and out.

Only wire.tracing.open_tracing imports this module, and only with tracing on. Spans wait in a
bounded queue and a background thread exports them; when the collector is down or slow the
queue fills and further spans are dropped and counted, never waited for."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, Protocol

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator


class TracingSettings(Protocol):
    """What this module reads of wire.tracing.TracingSettings (which imports this module
    lazily: a protocol here keeps the import one way)."""

    @property
    def protocol(self) -> str: ...
    @property
    def sampler(self) -> str: ...
    @property
    def sampler_arg(self) -> float: ...
    @property
    def max_queue_size(self) -> int: ...

    def url(self) -> str: ...
    def attributes(self) -> dict[str, str]: ...
    def service(self, default: str) -> str: ...


EXPORT_TIMEOUT_S = 5.0  # one export's limit (the exporter's thread waits, no request does)
# The OTLP exporters' own loggers: with the collector down each export logs its retries and
# its failure, several lines a second under load. At most one per interval gets through.
EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
)
EXPORTER_LOG_INTERVAL_S = 60.0
SCOPE = "dflash-serving"

# A span's kind by name (the callers' modules load without the SDK).
Kind = Literal["internal", "server", "client"]
KINDS: dict[str, SpanKind] = {
    "internal": SpanKind.INTERNAL,
    "server": SpanKind.SERVER,
    "client": SpanKind.CLIENT,
}

__all__ = ["Span", "Tracing"]


def sampler(settings: TracingSettings) -> Sampler:
    """OTEL_TRACES_SAMPLER's values; the parent-based ones follow a client's sampled flag."""
    name = settings.sampler.removeprefix("parentbased_")
    root: Sampler = {"always_on": ALWAYS_ON, "always_off": ALWAYS_OFF}.get(name) or (
        TraceIdRatioBased(settings.sampler_arg)
    )
    return ParentBased(root) if settings.sampler.startswith("parentbased_") else root


def exporter(settings: TracingSettings) -> SpanExporter:
    url = settings.url()
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=url, timeout=EXPORT_TIMEOUT_S)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter(endpoint=url, timeout=EXPORT_TIMEOUT_S)


class EveryInterval(logging.Filter):
    """One record per `interval_s` through; the others are dropped, and the next one let
    through says how many were."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s, self.clock = interval_s, clock
        self.last: float | None = None
        self.suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = self.clock()
        if self.last is not None and now - self.last < self.interval_s:
            self.suppressed += 1
            return False
        if self.suppressed:
            record.msg = f"{record.msg} ({self.suppressed} more like it were not logged)"
        self.last, self.suppressed = now, 0
        return True


class Pending:
    """Spans handed to the batch processor and not yet taken for export, and those dropped."""

    def __init__(self, limit: int) -> None:
        self.limit, self.count, self.dropped = limit, 0, 0
        self.lock = threading.Lock()
        self.on_drop: Callable[[], None] | None = None


class CountingExporter(SpanExporter):
    """The OTLP exporter, telling Pending when a batch leaves the queue."""

    def __init__(self, inner: SpanExporter, pending: Pending) -> None:
        self.inner, self.pending = inner, pending

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self.pending.lock:
            self.pending.count = max(0, self.pending.count - len(spans))
        return self.inner.export(spans)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class BoundedProcessor(SpanProcessor):
    """A BatchSpanProcessor whose overflow is counted here (the SDK's own count needs its
    metrics SDK): a span that would not fit in the queue is dropped before it is queued."""

    def __init__(self, inner: BatchSpanProcessor, pending: Pending) -> None:
        self.inner, self.pending = inner, pending

    def on_start(self, span: Any, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        pending = self.pending
        with pending.lock:
            full = pending.count >= pending.limit
            if full:
                pending.dropped += 1
            else:
                pending.count += 1
        if full:
            if pending.on_drop is not None:
                pending.on_drop()
            return
        self.inner.on_end(span)

    def shutdown(self) -> None:
        self.inner.shutdown()  # type: ignore[no-untyped-call]

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class FixedResource(Resource):
    """The process's resource, whose hash is computed once: OTLP's encoder groups every span
    by its resource, and Resource hashes by dumping its attributes to JSON on each call
    (about 7 % of a span's encoding). The attributes never change after startup."""

    def __init__(self, resource: Resource) -> None:
        super().__init__(resource.attributes, resource.schema_url)
        self._hash = super().__hash__()

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or super().__eq__(other)


class DecidedIds(RandomIdGenerator):
    """Random ids, except a trace id the sampler has already seen: `Tracing.begin` draws the
    id and asks the sampler before any span exists, and the span it then starts must carry
    that id (a ratio sampler decides by the id: a fresh one would sample p² of requests).
    Per thread, as the id is set and taken within one call."""

    def __init__(self) -> None:
        self.local = threading.local()

    def draw(self) -> int:
        return super().generate_trace_id()

    def generate_trace_id(self) -> int:
        decided: int | None = getattr(self.local, "decided", None)
        if decided is None:
            return super().generate_trace_id()
        self.local.decided = None
        return decided


class Tracing:
    """One process's tracer: its provider, exporter, sampler and resource, and the W3C
    propagator that reads a caller's context and writes this process's for the next hop."""

    def __init__(self, settings: TracingSettings, default_service: str) -> None:
        attributes: dict[str, Any] = {**settings.attributes()}
        attributes["service.name"] = settings.service(default_service)
        self.service_name = attributes["service.name"]
        self.pending = Pending(settings.max_queue_size)
        batch = BatchSpanProcessor(
            CountingExporter(exporter(settings), self.pending),
            max_queue_size=settings.max_queue_size,
            max_export_batch_size=min(512, settings.max_queue_size),
            schedule_delay_millis=500,
        )
        self.sampler, self.ids = sampler(settings), DecidedIds()
        self.provider = TracerProvider(
            sampler=self.sampler,
            resource=FixedResource(Resource.create(attributes)),
            id_generator=self.ids,
        )
        self.provider.add_span_processor(BoundedProcessor(batch, self.pending))
        self.tracer: Tracer = self.provider.get_tracer(SCOPE)
        self.propagator = TraceContextTextMapPropagator()
        self.quiet = EveryInterval(EXPORTER_LOG_INTERVAL_S)
        for name in EXPORTER_LOGGERS:
            logging.getLogger(name).addFilter(self.quiet)

    @property
    def dropped(self) -> int:
        return self.pending.dropped

    def on_drop(self, callback: Callable[[], None]) -> None:
        self.pending.on_drop = callback

    def extract(self, headers: Iterable[tuple[bytes, bytes]]) -> Context | None:
        """The caller's trace context from `traceparent`/`tracestate` (ASGI header pairs)."""
        carrier: dict[str, str] = {}
        for name, value in headers:
            if name in (b"traceparent", b"tracestate"):
                carrier[name.decode()] = value.decode("latin-1")
        return self.propagator.extract(carrier) if carrier else None

    def begin(
        self, name: str, headers: Iterable[tuple[bytes, bytes]], attributes: dict[str, Any]
    ) -> Span | bytes:
        """A request's server span if the sampler keeps it, else only the header lines that
        pass its decision on (`traceparent` with the sampled flag off): an unsampled request
        creates no span and no context, the cheap path at low sampling rates."""
        parent = self.extract(headers)
        remote = trace.get_current_span(parent).get_span_context() if parent else None
        valid = remote is not None and remote.is_valid
        trace_id = remote.trace_id if remote is not None and valid else self.ids.draw()
        result = self.sampler.should_sample(parent, trace_id, name, SpanKind.SERVER, attributes)
        if result.decision is Decision.DROP:
            span_id = self.ids.generate_span_id()
            lines = f"traceparent: 00-{trace_id:032x}-{span_id:016x}-00\r\n"
            if result.trace_state:
                lines += f"tracestate: {result.trace_state.to_header()}\r\n"
            return lines.encode("latin-1")
        if not valid:
            self.ids.local.decided = trace_id  # the span gets the id the sampler saw
        return self.tracer.start_span(
            name, context=parent, kind=SpanKind.SERVER, attributes=attributes
        )

    def context(self, span: Span) -> Context:
        """A context whose current span is `span`: the parent of the spans started in it."""
        return trace.set_span_in_context(span)

    def inject(self, span: Span) -> dict[str, str]:
        """`traceparent` (and `tracestate`) naming `span` as the next hop's parent."""
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, trace.set_span_in_context(span))
        return carrier

    def start(
        self,
        name: str,
        parent: Span | Context | None,
        kind: Kind = "internal",
        attributes: dict[str, Any] | None = None,
        start_time: int | None = None,
    ) -> Span:
        """A span below `parent`; `kind` by name, so that callers need not import the SDK."""
        context = trace.set_span_in_context(parent) if isinstance(parent, Span) else parent
        return self.tracer.start_span(
            name, context=context, kind=KINDS[kind], attributes=attributes, start_time=start_time
        )

    @staticmethod
    def fail(
        span: Span,
        message: str,
        attributes: dict[str, Any] | None = None,
        event: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        """A span in error, the one way both sides mark it: its attributes (the status code,
        `error.type`), an event naming what happened (with the same attributes and any
        `details`), and the ERROR status with the message."""
        if attributes:
            span.set_attributes(attributes)
        if event is not None:
            span.add_event(event, {**(attributes or {}), **(details or {})})
        span.set_status(Status(StatusCode.ERROR, message))

    def shutdown(self) -> None:
        """Flush what is queued (bounded by the exporter's timeout) and stop the thread."""
        self.provider.shutdown()
        for name in EXPORTER_LOGGERS:
            logging.getLogger(name).removeFilter(self.quiet)
