"""TracingSettings read OpenTelemetry's standard environment: off without an endpoint, the
traces endpoint over the general one, http/protobuf's /v1/traces, service names, resource
attributes; bad values refused at startup."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from wire.tracing import GATEWAY_SERVICE, TracingSettings, open_tracing


def test_off_without_an_endpoint_and_when_the_sdk_is_disabled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert not TracingSettings().enabled
    assert open_tracing(TracingSettings(), GATEWAY_SERVICE) is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert TracingSettings().enabled
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not TracingSettings().enabled


def test_the_standard_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "edge")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.01")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod,team=a%2Cb")
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "100")
    s = TracingSettings()
    assert s.url() == "http://collector:4318/v1/traces"
    assert (s.sampler, s.sampler_arg, s.max_queue_size) == ("parentbased_traceidratio", 0.01, 100)
    assert s.attributes() == {"deployment.environment": "prod", "team": "a,b"}
    assert s.service(GATEWAY_SERVICE) == "edge"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4318/custom")
    assert TracingSettings().url() == "http://traces:4318/custom"  # taken as it is


def test_grpc_takes_the_base_endpoint_and_service_names_fall_back() -> None:
    s = TracingSettings(endpoint="http://collector:4317")
    assert s.protocol == "grpc" and s.url() == "http://collector:4317"
    assert s.service(GATEWAY_SERVICE) == "dflash-gateway"
    named = TracingSettings(endpoint="x", resource_attributes="service.name=from-attrs")
    assert named.service(GATEWAY_SERVICE) == "from-attrs"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
        ("OTEL_TRACES_SAMPLER", "sometimes"),
        ("OTEL_TRACES_SAMPLER_ARG", "2"),
        ("OTEL_BSP_MAX_QUEUE_SIZE", "0"),
    ],
)
def test_bad_values_are_refused(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError):
        TracingSettings()
