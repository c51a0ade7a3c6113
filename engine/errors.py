"""The worker's error hierarchy and its one renderer (OpenAI error bodies, never a bare 500)."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("engine.server")


class WorkerError(Exception):
    """An error a client sees as `{"error": {"message", "type", "param", "code"}}`."""

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


class InvalidRequest(WorkerError):
    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationFailed(WorkerError):
    status_code = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"


class NotFound(WorkerError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(WorkerError):
    status_code = 405
    error_type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLarge(WorkerError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class Unavailable(WorkerError):
    """Not ready, draining, or full; the client may retry (Retry-After)."""

    status_code = 503
    error_type = "service_unavailable"
    code = "unavailable"

    def __init__(self, message: str, *, code: str | None = None, retry_after: int = 1) -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(retry_after)})


class InternalError(WorkerError):
    """The engine failed on a request; the process keeps serving."""


def error_body(
    message: str, error_type: str, param: str | None, code: str | None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def sse_error(err: WorkerError) -> bytes:
    """An error after the first streamed byte goes in-band as a final SSE event."""
    return f"data: {json.dumps(err.body())}\n\n".encode()


def render(err: WorkerError, request_id: str | None = None) -> JSONResponse:
    headers = dict(err.headers)
    if request_id:
        headers["X-Request-Id"] = request_id
    return JSONResponse(err.body(), status_code=err.status_code, headers=headers)


def from_validation_errors(errors: list[Any]) -> InvalidRequest:
    """pydantic's first complaint as a 400 naming the parameter (FastAPI would say 422)."""
    if not errors:
        return InvalidRequest("invalid request")
    first = errors[0]
    param = _param_path(first.get("loc", ())) or None
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return InvalidRequest(f"{param}: {msg}" if param else msg, param=param)


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param_path(loc: Any) -> str:
    """pydantic's loc as a client would write it: messages[0].role (union tags dropped)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part != "body" and "[" not in str(part) and str(part) not in _UNION_TAGS:
            path += f".{part}" if path else str(part)
    return path


def _http_error(exc: StarletteHTTPException) -> WorkerError:
    if exc.status_code == 404:
        return NotFound("no such route")
    if exc.status_code == 405:
        return MethodNotAllowed("method not allowed on this route")
    if exc.status_code == 413:
        return PayloadTooLarge(str(exc.detail))
    if 400 <= exc.status_code < 500:
        return InvalidRequest(str(exc.detail))
    return InternalError(str(exc.detail))


def install_handlers(app: FastAPI) -> None:
    """Route every exception through `render` so clients only ever see OpenAI bodies."""

    def rid(request: Request) -> str | None:
        return getattr(request.state, "request_id", None)

    async def on_worker_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, WorkerError)
        return render(exc, rid(request))

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return render(from_validation_errors(list(exc.errors())), rid(request))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return render(_http_error(exc), rid(request))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error", exc_info=exc)
        return render(InternalError("internal error; see the worker log"), rid(request))

    app.add_exception_handler(WorkerError, on_worker_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
