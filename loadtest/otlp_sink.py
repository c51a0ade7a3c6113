"""A local OTLP/gRPC sink for `dflash-bench gateway --peers --tracing`: OpenTelemetry's own
TraceService (opentelemetry-proto's generated servicer on grpcio) that decodes each export and
counts its spans, so the traced gateways pay the whole export path (batching, protobuf, gRPC).

    python -m loadtest.otlp_sink --port P     # prints "spans N" on SIGTERM
"""

from __future__ import annotations

import argparse
import signal
import threading
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = 0
        self.lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        count = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self.lock:
            self.spans += count
        return trace_service_pb2.ExportTraceServiceResponse()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="otlp_sink")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    sink = Sink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    done.wait()
    server.stop(grace=None)
    print(f"spans {sink.spans}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
