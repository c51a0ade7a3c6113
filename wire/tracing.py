"""Tracing settings, read once at the edge from OpenTelemetry's standard environment
(`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_PROTOCOL`, `OTEL_SERVICE_NAME`,
`OTEL_TRACES_SAMPLER`/`_ARG`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_BSP_MAX_QUEUE_SIZE`).

This module imports nothing of OpenTelemetry: with tracing off (no endpoint) neither the
gateway nor the worker loads the SDK. `open_tracing` imports wire.otel only when it is on."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal
from urllib.parse import unquote

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

if TYPE_CHECKING:
    from wire.otel import Tracing

OtlpProtocol = Literal["grpc", "http/protobuf"]
SamplerName = Literal[
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
]
# gen_ai.operation.name of each endpoint (the GenAI conventions' well-known values): the
# gateway's and the worker's spans of one request name it alike (a Responses request runs as
# a chat).
OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/responses": "chat",
}
# The default service name of each kind of process (OTEL_SERVICE_NAME overrides it).
GATEWAY_SERVICE = "dflash-gateway"
WORKER_SERVICE = "dflash-worker"


def operation(endpoint: str) -> str:
    """The GenAI operation of a request to `endpoint` (its last path part if not listed)."""
    return OPERATIONS.get(endpoint, endpoint.rsplit("/", 1)[-1] or "request")


def _env(name: str, *more: str) -> AliasChoices:
    return AliasChoices(name, *more)


class TracingSettings(BaseSettings):
    """OTLP export of traces. Off unless an endpoint is set (and OTEL_SDK_DISABLED is not)."""

    model_config = SettingsConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    # The collector's base URL (http/protobuf appends /v1/traces) ...
    endpoint: str | None = Field(
        default=None, validation_alias=_env("endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT")
    )
    # ... or the traces URL itself, which wins, as OpenTelemetry's environment defines.
    traces_endpoint: str | None = Field(
        default=None,
        validation_alias=_env("traces_endpoint", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
    )
    protocol: OtlpProtocol = Field(
        default="grpc",
        validation_alias=_env(
            "protocol", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"
        ),
    )
    service_name: str | None = Field(
        default=None, min_length=1, validation_alias=_env("service_name", "OTEL_SERVICE_NAME")
    )
    sampler: SamplerName = Field(
        default="parentbased_always_on", validation_alias=_env("sampler", "OTEL_TRACES_SAMPLER")
    )
    sampler_arg: float = Field(
        default=1.0, ge=0.0, le=1.0, validation_alias=_env("sampler_arg", "OTEL_TRACES_SAMPLER_ARG")
    )
    resource_attributes: str = Field(
        default="", validation_alias=_env("resource_attributes", "OTEL_RESOURCE_ATTRIBUTES")
    )
    # Spans waiting for export; beyond it they are dropped (and counted), never waited for.
    max_queue_size: int = Field(
        default=2048, ge=1, validation_alias=_env("max_queue_size", "OTEL_BSP_MAX_QUEUE_SIZE")
    )
    disabled: bool = Field(default=False, validation_alias=_env("disabled", "OTEL_SDK_DISABLED"))

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint or self.traces_endpoint) and not self.disabled

    def url(self) -> str:
        """Where spans go: the traces endpoint as given, else the base one (plus /v1/traces
        over HTTP; gRPC takes the base as it is)."""
        if self.traces_endpoint:
            return self.traces_endpoint
        base = self.endpoint or ""
        return base if self.protocol == "grpc" else base.rstrip("/") + "/v1/traces"

    def attributes(self) -> dict[str, str]:
        """OTEL_RESOURCE_ATTRIBUTES: `key=value` pairs, comma-separated, values %-encoded."""
        pairs = (item.partition("=") for item in self.resource_attributes.split(",") if item)
        return {k.strip(): unquote(v.strip()) for k, sep, v in pairs if sep and k.strip()}

    def service(self, default: str) -> str:
        """OTEL_SERVICE_NAME, else a service.name resource attribute, else the process's own."""
        return self.service_name or self.attributes().get("service.name") or default


def open_tracing(settings: TracingSettings, default_service: str) -> Tracing | None:
    """The process's tracer and exporter, or None when tracing is off. Requires the
    `tracing` extra when on (a clear error at startup names it)."""
    if not settings.enabled:
        return None
    try:
        from wire.otel import Tracing
    except ImportError as exc:  # the SDK is an optional extra
        raise RuntimeError(
            "OTEL_EXPORTER_OTLP_ENDPOINT is set but OpenTelemetry is not installed: "
            "pip install 'dflash-serving[tracing]'"
        ) from exc
    return Tracing(settings, default_service)
