"""Tracing end to end (docs/tracing.md): the real gateway exports over OTLP/gRPC and a real
embedded worker over OTLP/HTTP to receivers decoding OpenTelemetry's own protobuf; one trace
per request from the client's traceparent through the gateway's attempt into the worker's
queue, prefill and decode; refusals, worker failures and a dead collector."""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.routing.fleet import worker_id
from tests.fixtures.otlp import OtlpGrpcReceiver, OtlpHttpReceiver, Received, by_name
from tests.fixtures.worker import ROOT, WorkerHandle, free_port, running_worker
from tests.service.conftest import MODEL, Gateway, running_gateway, worker_args
from tests.service.fake_upstream import Request, endless_stream, fake_worker, reply
from wire.tracing import TracingSettings

GATEWAY, WORKER = "dflash-gateway", "dflash-worker"
KEY = "sk-tracing-" + secrets.token_hex(8)


@pytest.fixture(scope="module")
def received() -> Iterator[Received]:
    shared = Received()
    with OtlpGrpcReceiver(shared) as grpc_in, OtlpHttpReceiver(shared) as http_in:
        shared.grpc_endpoint = grpc_in.endpoint  # type: ignore[attr-defined]
        shared.http_endpoint = http_in.endpoint  # type: ignore[attr-defined]
        yield shared


@pytest.fixture(scope="module")
def traced_worker(tiny_checkpoint: Any, received: Received) -> Iterator[WorkerHandle]:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": received.http_endpoint,  # type: ignore[attr-defined]
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    }
    with running_worker(*worker_args(tiny_checkpoint), env=env) as handle:
        yield handle


@pytest.fixture(scope="module")
def gateway(
    traced_worker: WorkerHandle, received: Received, tmp_path_factory: Any
) -> Iterator[Gateway]:
    keys = Path(tmp_path_factory.mktemp("keys")) / "keys.yaml"
    keys.write_text(
        f"tenants:\n  - {{name: team-a, keys: [{KEY}], requests_per_minute: 1000}}\n"
        f"  - {{name: team-b, keys: [{KEY}-b], requests_per_minute: 1}}\n"
    )
    tracing = TracingSettings(endpoint=received.grpc_endpoint, protocol="grpc")  # type: ignore[attr-defined]
    with running_gateway(
        workers=[traced_worker.base_url], api_key_file=keys, tracing=tracing
    ) as gw:
        yield gw


def parent_of(child: Any, spans: list[Any]) -> Any:
    found = [s for s in spans if s.span_id == child.parent_id]
    assert found, f"{child.service}/{child.name} has no parent among the trace's spans"
    return found[0]


def complete_trace(trace_id: str, worker_spans: int = 4):  # type: ignore[no-untyped-def]
    def check(spans: list[Any]) -> bool:
        mine = [s for s in spans if s.trace_id == trace_id]
        gateway_done = any(s.service == GATEWAY and s.kind == 2 for s in mine)  # SERVER
        return gateway_done and sum(s.service == WORKER for s in mine) >= worker_spans

    return check


def test_one_trace_from_the_client_through_gateway_and_worker(
    gateway: Gateway, received: Received, traced_worker: WorkerHandle
) -> None:
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    response = httpx.post(
        gateway.v1 + "/chat/completions",
        headers={
            "authorization": f"Bearer {KEY}",
            "traceparent": f"00-{trace_id}-{client_span}-01",
            "tracestate": "client=1",
        },
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "def add(a, b):"}],
            "max_tokens": 12,
            "temperature": 0,
        },
        timeout=60,
    )
    assert response.status_code == 200, response.text
    received.wait(complete_trace(trace_id))
    spans = received.trace(trace_id)

    [server] = [s for s in spans if s.service == GATEWAY and s.kind == 2]
    assert server.parent_id == client_span  # the client's trace continued
    assert server.name == "POST /v1/chat/completions" and not server.error
    attrs = server.attributes
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == MODEL
    assert attrs["gen_ai.request.max_tokens"] == 12
    assert attrs["gen_ai.request.temperature"] == 0.0
    usage = response.json()["usage"]
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert attrs["gen_ai.response.finish_reasons"] == [
        response.json()["choices"][0]["finish_reason"]
    ]
    spec = response.json()["metrics"]["speculative_decoding"]
    assert attrs["dflash.spec.steps"] == spec["num_spec_steps"] > 0
    assert attrs["dflash.spec.draft_tokens"] == spec["num_draft_tokens"]
    assert attrs["dflash.spec.accepted_tokens"] == spec["num_accepted_draft_tokens"]
    assert attrs["dflash.spec.mean_acceptance_length"] == pytest.approx(
        spec["mean_acceptance_length"]
    )

    # The key and the tenant's limits: one span, naming the tenant (never the key).
    [admission] = by_name(spans, GATEWAY, "admission")
    assert admission.attributes == {"dflash.tenant": "team-a"}
    assert parent_of(admission, spans) is server and not admission.error
    # Each fact once: the model on the server span, the pool and worker (its metrics label)
    # on the routing decision, the address called on the attempt.
    [route] = by_name(spans, GATEWAY, "route")
    assert parent_of(route, spans) is server
    assert route.attributes == {
        "dflash.pool": "default",
        "dflash.worker": worker_id(traced_worker.base_url),
    }
    [attempt] = by_name(spans, GATEWAY, "attempt 1")
    assert attempt.kind == 3 and parent_of(attempt, spans) is server  # CLIENT
    assert attempt.attributes == {
        "dflash.attempt": 1,
        "server.address": traced_worker.base_url,
        "http.response.status_code": 200,
    }
    [first_byte] = by_name(spans, GATEWAY, "first_byte")
    assert parent_of(first_byte, spans) is attempt
    assert not by_name(spans, GATEWAY, "stream")  # a whole answer: its attempt ends with it
    every_value = [str(v) for s in spans for v in s.attributes.values()]
    assert not [v for v in every_value if KEY in v]  # never a key

    [worker] = [s for s in spans if s.service == WORKER and s.kind == 2]
    assert parent_of(worker, spans) is attempt  # the gateway's context reached the worker
    assert worker.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    phases = {name: by_name(spans, WORKER, name) for name in ("queue", "prefill", "decode")}
    for name, found in phases.items():
        assert len(found) == 1, name
        assert parent_of(found[0], spans) is worker
    decode = phases["decode"][0].attributes
    assert decode["dflash.spec.steps"] == spec["num_spec_steps"]
    assert decode["dflash.spec.draft_tokens"] == spec["num_draft_tokens"]
    assert decode["dflash.spec.accepted_tokens"] == spec["num_accepted_draft_tokens"]
    assert decode["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert phases["queue"][0].end_ns <= phases["prefill"][0].start_ns + 1000
    assert phases["prefill"][0].end_ns <= phases["decode"][0].start_ns + 1000


def test_a_stream_has_first_byte_and_stream_spans_and_exemplars(
    gateway: Gateway, received: Received
) -> None:
    trace_id = secrets.token_hex(16)
    body = {
        "model": MODEL,
        "prompt": "def fib(n):",
        "max_tokens": 8,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {KEY}", "traceparent": f"00-{trace_id}-{'1' * 16}-01"}
    with httpx.stream(
        "POST", gateway.v1 + "/completions", headers=headers, json=body, timeout=60
    ) as response:
        assert response.status_code == 200
        text = "".join(response.iter_text())
    assert text.rstrip().endswith("data: [DONE]")
    received.wait(complete_trace(trace_id))
    spans = received.trace(trace_id)
    [server] = [s for s in spans if s.service == GATEWAY and s.kind == 2]
    assert server.attributes["gen_ai.operation.name"] == "text_completion"
    assert server.attributes["gen_ai.usage.output_tokens"] > 0
    assert server.attributes["gen_ai.response.finish_reasons"] in (["length"], ["stop"])
    [attempt] = by_name(spans, GATEWAY, "attempt 1")
    [stream] = by_name(spans, GATEWAY, "stream")
    assert parent_of(stream, spans) is attempt and not stream.error
    # With tracing on, the latency histograms carry the request's trace id (OpenMetrics).
    exposition = httpx.get(
        gateway.base_url + "/metrics",
        headers={"accept": "application/openmetrics-text; version=1.0.0"},
        timeout=10,
    ).text
    families = (
        "dflash_time_to_first_token_seconds",
        "dflash_time_per_output_token_seconds",
        "dflash_request_duration_seconds",
    )
    for family in families:
        assert [
            line
            for line in exposition.splitlines()
            if line.startswith(family + "_bucket") and f'trace_id="{trace_id}"' in line
        ], family


def test_a_429_gives_an_error_span(gateway: Gateway, received: Received) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    headers = {"authorization": f"Bearer {KEY}-b"}
    statuses = []
    trace_ids = []
    for _ in range(2):
        trace_id = secrets.token_hex(16)
        trace_ids.append(trace_id)
        headers["traceparent"] = f"00-{trace_id}-{'2' * 16}-01"
        statuses.append(
            httpx.post(gateway.v1 + "/completions", headers=headers, json=body).status_code
        )
    assert statuses == [200, 429]
    refused = trace_ids[1]
    received.wait(lambda spans: any(s.trace_id == refused and s.kind == 2 for s in spans))
    spans = received.trace(refused)
    [server] = [s for s in spans if s.kind == 2]
    assert server.error and server.attributes["http.response.status_code"] == 429
    [admission] = by_name(spans, GATEWAY, "admission")
    assert admission.error and "refused" in admission.events
    assert admission.attributes["http.response.status_code"] == 429
    assert admission.attributes["dflash.tenant"] == "team-b"
    assert not by_name(spans, GATEWAY, "attempt 1")  # never reached a worker


def test_a_bad_key_gives_an_error_span(gateway: Gateway, received: Received) -> None:
    trace_id = secrets.token_hex(16)
    response = httpx.post(
        gateway.v1 + "/completions",
        headers={"authorization": "Bearer wrong", "traceparent": f"00-{trace_id}-{'3' * 16}-01"},
        json={"model": MODEL, "prompt": "x"},
    )
    assert response.status_code == 401
    received.wait(lambda spans: any(s.trace_id == trace_id and s.kind == 2 for s in spans))
    spans = received.trace(trace_id)
    [admission] = by_name(spans, GATEWAY, "admission")
    assert admission.error and "refused" in admission.events
    assert admission.attributes["http.response.status_code"] == 401
    assert "dflash.tenant" not in admission.attributes
    [server] = [s for s in spans if s.kind == 2]
    assert server.error and server.attributes["error.type"] == "invalid_api_key"


def test_a_tenant_s_request_refused_before_its_limits_still_names_the_tenant(
    gateway: Gateway, received: Received
) -> None:
    """No limits checked (an unknown model: 404): the admission span is the key check's."""
    trace_id = secrets.token_hex(16)
    response = httpx.post(
        gateway.v1 + "/completions",
        headers={"authorization": f"Bearer {KEY}", "traceparent": f"00-{trace_id}-{'5' * 16}-01"},
        json={"model": "no-such-model", "prompt": "x"},
    )
    assert response.status_code == 404
    received.wait(lambda spans: any(s.trace_id == trace_id and s.kind == 2 for s in spans))
    spans = received.trace(trace_id)
    [admission] = by_name(spans, GATEWAY, "admission")
    assert admission.attributes == {"dflash.tenant": "team-a"} and not admission.error
    [server] = [s for s in spans if s.kind == 2]
    assert admission.start_ns >= server.start_ns and admission.end_ns <= server.end_ns


async def failing(request: Request, writer: asyncio.StreamWriter) -> None:
    writer.write(reply("500 Internal Server Error", b'{"error":{"message":"boom"}}'))


def test_a_worker_failure_gives_error_spans_and_a_retry_is_a_second_attempt(
    received: Received,
) -> None:
    tracing = TracingSettings(endpoint=received.grpc_endpoint)  # type: ignore[attr-defined]
    with (
        fake_worker(failing) as one,
        fake_worker(failing) as two,
        running_gateway(workers=[one.url, two.url], max_retries=1, tracing=tracing) as gw,
    ):
        trace_id = secrets.token_hex(16)
        response = httpx.post(
            gw.v1 + "/completions",
            headers={"traceparent": f"00-{trace_id}-{'4' * 16}-01"},
            json={"model": "fake", "prompt": "x"},
            timeout=30,
        )
        assert response.status_code == 502
        # Each worker got the attempt's own context.
        sent = [r.headers[b"traceparent"].decode() for r in one.seen + two.seen]
    spans = received.wait(lambda s: any(x.trace_id == trace_id and x.kind == 2 for x in s))
    spans = received.trace(trace_id)
    attempts = sorted((s for s in spans if s.name.startswith("attempt ")), key=lambda s: s.name)
    assert [a.name for a in attempts] == ["attempt 1", "attempt 2"]
    for attempt in attempts:
        assert attempt.error and "upstream_failure" in attempt.events
        assert attempt.attributes["error.type"] == "status_5xx"
    assert sorted(sent) == sorted(f"00-{trace_id}-{a.span_id}-01" for a in attempts)
    # The retry went to the other worker: each routing decision names the worker its
    # attempt then called.
    routes = sorted(by_name(spans, GATEWAY, "route"), key=lambda s: s.start_ns)
    called = [a.attributes["server.address"] for a in attempts]
    assert sorted(called) == sorted([one.url, two.url])
    assert [r.attributes["dflash.worker"] for r in routes] == [worker_id(u) for u in called]
    [server] = [s for s in spans if s.kind == 2]
    assert server.error and server.attributes["http.response.status_code"] == 502


def test_a_client_disconnect_gives_an_error_span(received: Received) -> None:
    tracing = TracingSettings(endpoint=received.grpc_endpoint)  # type: ignore[attr-defined]
    trace_id = secrets.token_hex(16)
    with (
        fake_worker(endless_stream) as fake,
        running_gateway(workers=[fake.url], tracing=tracing) as gw,
        httpx.stream(
            "POST",
            gw.v1 + "/completions",
            headers={"traceparent": f"00-{trace_id}-{'6' * 16}-01"},
            json={"model": "fake", "prompt": "x", "stream": True},
            timeout=30,
        ) as response,
    ):
        assert response.status_code == 200
        next(response.iter_bytes())  # the stream is flowing; then the client leaves
    spans = received.wait(lambda s: any(x.trace_id == trace_id and x.kind == 2 for x in s))
    spans = received.trace(trace_id)
    [server] = [s for s in spans if s.kind == 2]
    assert server.error and "client_disconnected" in server.events
    assert server.attributes["http.response.status_code"] == 499


def test_a_dead_collector_neither_fails_nor_slows_requests_and_drops_are_counted() -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens
    tracing = TracingSettings(endpoint=dead, max_queue_size=4)
    with fake_worker() as fake, running_gateway(workers=[fake.url], tracing=tracing) as gw:
        with httpx.Client(timeout=10) as client:
            for _ in range(20):
                response = client.post(
                    gw.v1 + "/completions", json={"model": "fake", "prompt": "x"}
                )
                assert response.status_code == 200
        assert gw.metric("dflash_trace_spans_dropped_total") > 0


def test_with_tracing_off_neither_the_sdk_nor_an_exporter_is_loaded() -> None:
    """FastAPI itself imports OpenTelemetry's API when it is installed (fastapi.telemetry; a
    no-op without a global provider, which this project never sets); the SDK, the exporters
    and wire.otel stay out."""
    code = (
        "import sys\n"
        "from service.app import create_app\n"
        "from service.settings import GatewaySettings\n"
        "create_app(GatewaySettings())\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(\n"
        "    ('opentelemetry.sdk', 'opentelemetry.exporter', 'grpc', 'wire.otel')))\n"
        "assert not loaded, loaded\n"
    )
    env = {"PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_answer_s_finish_reason_is_read_from_its_status(
    gateway: Gateway, received: Received, stream: bool
) -> None:
    """/v1/responses: an answer cut by max_output_tokens (status incomplete) gives `length`,
    whole or streamed (from the final response.incomplete event's object)."""
    trace_id = secrets.token_hex(16)
    body = {"model": MODEL, "input": "def fib(n):", "max_output_tokens": 2, "store": False}
    response = httpx.post(
        gateway.v1 + "/responses",
        headers={"authorization": f"Bearer {KEY}", "traceparent": f"00-{trace_id}-{'2' * 16}-01"},
        json={**body, "stream": stream},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert ("response.incomplete" in response.text) == stream
    received.wait(complete_trace(trace_id))
    spans = received.trace(trace_id)
    [server] = [s for s in spans if s.service == GATEWAY and s.kind == 2]
    assert server.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert server.attributes["gen_ai.response.model"] == MODEL
    # The embedded worker continues the trace below the gateway's attempt, as for chat.
    [attempt] = by_name(spans, GATEWAY, "attempt 1")
    [worker] = [s for s in spans if s.service == WORKER and s.kind == 2]
    assert worker.name == "POST /v1/responses" and not worker.error
    assert parent_of(worker, spans) is attempt
    assert worker.attributes["gen_ai.operation.name"] == "chat"
    assert worker.attributes["gen_ai.request.model"] == MODEL
    assert (
        worker.attributes["gen_ai.usage.input_tokens"]
        == server.attributes["gen_ai.usage.input_tokens"]
    )
    for name in ("queue", "prefill", "decode"):
        [phase] = by_name(spans, WORKER, name)
        assert parent_of(phase, spans) is worker, name
    decode = by_name(spans, WORKER, "decode")[0].attributes
    assert decode["gen_ai.response.finish_reasons"] == ["length"]
    assert decode["gen_ai.usage.output_tokens"] == 2
    for key in ("dflash.spec.steps", "dflash.spec.draft_tokens", "dflash.spec.accepted_tokens"):
        assert decode[key] == server.attributes[key], key  # the worker's count, as reported
    assert decode["dflash.spec.steps"] > 0


def test_a_responses_request_the_worker_refuses_gives_its_error_span(
    traced_worker: WorkerHandle, received: Received
) -> None:
    """Straight to the embedded worker (no gateway): `store: true` is the gateway's, a 400."""
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    response = httpx.post(
        traced_worker.base_url + "/v1/responses",
        headers={"traceparent": f"00-{trace_id}-{parent}-01"},
        json={"model": MODEL, "input": "x", "store": True},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    received.wait(lambda s: any(x.trace_id == trace_id for x in s))
    [worker] = [s for s in received.trace(trace_id) if s.service == WORKER]
    assert worker.parent_id == parent and worker.error
    assert worker.attributes["http.response.status_code"] == 400
    assert worker.attributes["error.type"] == response.json()["error"]["type"]
