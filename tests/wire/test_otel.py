"""The SDK side: samplers from OTEL_TRACES_SAMPLER, W3C context in and out, the process's own
provider (never the global one), and the bounded queue that drops and counts."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from wire.otel import Tracing, sampler
from wire.tracing import WORKER_SERVICE, TracingSettings

DEAD = "http://127.0.0.1:9"  # discard port: nothing answers


def test_samplers() -> None:
    ratio = sampler(TracingSettings(sampler="traceidratio", sampler_arg=0.01))
    assert isinstance(ratio, TraceIdRatioBased) and ratio.rate == 0.01
    assert isinstance(sampler(TracingSettings()), ParentBased)


def test_context_in_and_out_and_no_global_provider() -> None:
    before = trace.get_tracer_provider()
    tracing = Tracing(TracingSettings(endpoint=DEAD), WORKER_SERVICE)
    try:
        assert trace.get_tracer_provider() is before
        tid, sid = "ab" * 16, "cd" * 8
        parent = tracing.extract([(b"traceparent", f"00-{tid}-{sid}-01".encode())])
        span = tracing.start("x", parent)
        assert format(span.get_span_context().trace_id, "032x") == tid
        carrier = tracing.inject(span)
        span_id = format(span.get_span_context().span_id, "016x")
        assert carrier["traceparent"] == f"00-{tid}-{span_id}-01"
        span.end()
        assert tracing.service_name == "dflash-worker"
        assert tracing.extract([(b"x-other", b"1")]) is None
    finally:
        tracing.shutdown()


def test_a_full_queue_drops_and_counts() -> None:
    tracing = Tracing(TracingSettings(endpoint=DEAD, max_queue_size=3), WORKER_SERVICE)
    counted: list[int] = []
    tracing.on_drop(lambda: counted.append(1))
    try:
        tracing.pending.count = 3  # the queue is full (its exporter never keeps up here)
        tracing.start("dropped", None).end()
        assert tracing.dropped == 1 and counted == [1]
    finally:
        tracing.pending.count = 0
        tracing.shutdown()
