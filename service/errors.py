"""One error hierarchy and one renderer: every error a client sees is an OpenAI error body."""

from __future__ import annotations

import json
from typing import Any


class GatewayError(Exception):
    """An error rendered as `{"error": {"message", "type", "param", "code"}}`."""

    status_code = 500
    error_type = "internal_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


class InvalidRequest(GatewayError):
    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationFailed(GatewayError):
    status_code = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"


class NotFound(GatewayError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class PayloadTooLarge(GatewayError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class UpstreamError(GatewayError):
    """A worker failed and no other worker could take the request."""

    status_code = 502
    error_type = "upstream_error"
    code = "bad_gateway"


class UpstreamTimeout(UpstreamError):
    status_code = 504
    code = "upstream_timeout"


class NoHealthyWorker(GatewayError):
    status_code = 503
    error_type = "service_unavailable"
    code = "no_healthy_worker"


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def status_error_type(status: int) -> str:
    """OpenAI-style error type for an HTTP status the framework produced (404, 405, ...)."""
    if status == 401:
        return "invalid_request_error"
    if status < 500:
        return "invalid_request_error"
    return "internal_error"


def sse_error_event(message: str, error_type: str, code: str | None) -> bytes:
    """The final in-band event of a stream whose worker failed after the first byte."""
    payload = json.dumps(error_body(message, error_type, None, code), separators=(",", ":"))
    return b"data: " + payload.encode() + b"\n\ndata: [DONE]\n\n"


class WorkersBusy(GatewayError):
    """Every worker tried answered 503 (its queue is full)."""

    status_code = 503
    error_type = "service_unavailable"
    code = "workers_busy"
