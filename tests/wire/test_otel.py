"""The SDK side: samplers from OTEL_TRACES_SAMPLER, W3C context in and out, the process's own
provider (never the global one), and the bounded queue that drops and counts."""

from __future__ import annotations

import logging

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from wire.otel import EXPORTER_LOGGERS, EveryInterval, FixedResource, Tracing, sampler
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


def test_begin_samples_once_by_the_id_the_span_gets() -> None:
    """An unsampled request gets only a traceparent with the sampled flag off; a sampled one
    a span carrying the very trace id the ratio sampler decided on (never a second draw)."""
    tracing = Tracing(TracingSettings(endpoint=DEAD, sampler="traceidratio", sampler_arg=0.5), "x")
    bound = TraceIdRatioBased.get_bound_for_rate(0.5)
    kept = dropped = 0
    try:
        for _ in range(200):
            begun = tracing.begin("GET /x", [], {})
            if isinstance(begun, bytes):
                version, trace_id, _span_id, flags = begun.split(b"\r\n")[0].split(b"-")
                assert version == b"traceparent: 00" and flags == b"00"
                assert int(trace_id, 16) & TraceIdRatioBased.TRACE_ID_LIMIT >= bound
                dropped += 1
            else:
                assert begun.is_recording()  # the SDK's own decision agreed
                assert begun.get_span_context().trace_id & TraceIdRatioBased.TRACE_ID_LIMIT < bound
                begun.end()
                kept += 1
        assert kept and dropped
        tid = "ab" * 16  # a client's unsampled trace continues unsampled, same trace id
        header = [(b"traceparent", f"00-{tid}-{'cd' * 8}-00".encode())]
        parentbased = Tracing(TracingSettings(endpoint=DEAD), "x")
        try:
            begun = parentbased.begin("GET /x", header, {})
            assert isinstance(begun, bytes) and begun.startswith(f"traceparent: 00-{tid}-".encode())
        finally:
            parentbased.shutdown()
    finally:
        tracing.shutdown()


def test_the_resource_hash_is_the_sdks() -> None:
    resource = Resource.create({"service.name": "x", "k": "v"})
    fixed = FixedResource(resource)
    assert hash(fixed) == hash(resource) and fixed == resource
    assert fixed.attributes == resource.attributes


def test_the_exporters_warnings_are_rate_limited() -> None:
    """A dead collector: one exporter warning per interval, the next says how many were not."""
    now = [0.0]
    quiet = EveryInterval(60.0, clock=lambda: now[0])

    def record() -> logging.LogRecord:
        return logging.LogRecord("x", logging.WARNING, __file__, 1, "export failed", None, None)

    assert quiet.filter(record())
    assert not any(quiet.filter(record()) for _ in range(5))
    now[0] = 61.0
    passed = record()
    assert quiet.filter(passed) and passed.getMessage().endswith("(5 more like it were not logged)")
    tracing = Tracing(TracingSettings(endpoint=DEAD), WORKER_SERVICE)
    logger = logging.getLogger(EXPORTER_LOGGERS[0])
    try:
        assert tracing.quiet in logger.filters
    finally:
        tracing.shutdown()
    assert tracing.quiet not in logger.filters
