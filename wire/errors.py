"""One error hierarchy and one renderer, for the gateway and the embedded worker alike.

Every error a client sees is an OpenAI error body `{"error": {"message", "type", "param",
"code"}}` with the right status code and the request id. This module is torch-free, so the
worker (engine/) imports it too; the gateway never imports engine/.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match


class ApiError(Exception):
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

    def sse(self) -> bytes:
        """The error as the final in-band SSE events (after the first streamed byte): the
        error object, then [DONE]."""
        body = json.dumps(self.body(), separators=(",", ":")).encode()
        return b"data: " + body + b"\n\n" + b"data: [DONE]\n\n"


class InvalidRequest(ApiError):
    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationFailed(ApiError):
    """401 worded as OpenAI words it: clients (LiteLLM among them) tell an auth failure from
    a bad request by "Incorrect API key provided"."""

    status_code = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"
    MESSAGE = "Incorrect API key provided: send a valid key as `Authorization: Bearer <key>`."

    def __init__(self, message: str = MESSAGE, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)


class PermissionDenied(ApiError):
    """403: the key is valid but may not do this (an operator's action without an admin key)."""

    status_code = 403
    error_type = "permission_error"
    code = "permission_denied"


class NotFound(ApiError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(ApiError):
    status_code = 405
    error_type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLarge(ApiError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class Unavailable(ApiError):
    """Not ready, draining, or full; the client may retry (Retry-After)."""

    status_code = 503
    error_type = "service_unavailable"
    code = "unavailable"

    def __init__(self, message: str, *, code: str | None = None, retry_after: int = 1) -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(retry_after)})


class ClientClosedRequest(ApiError):
    """The client left before the answer was ready (nginx's 499); nobody reads the body."""

    status_code = 499
    error_type = "client_closed_request"
    code = "client_closed_request"


class InternalError(ApiError):
    """A failure on our side; the process keeps serving."""


class UpstreamError(ApiError):
    """A worker failed and no other worker could take the request."""

    status_code = 502
    error_type = "upstream_error"
    code = "bad_gateway"


class UpstreamTimeout(UpstreamError):
    status_code = 504
    code = "upstream_timeout"


class NoHealthyWorker(ApiError):
    status_code = 503
    error_type = "service_unavailable"
    code = "no_healthy_worker"


class WorkersBusy(ApiError):
    """Every worker tried answered 503 (its queue is full)."""

    status_code = 503
    error_type = "service_unavailable"
    code = "workers_busy"


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def render(
    err: ApiError, request_id: str | None = None, extra: dict[str, str] | None = None
) -> JSONResponse:
    headers = {**err.headers, **(extra or {})}
    if request_id:
        headers["X-Request-Id"] = request_id
    return JSONResponse(err.body(), status_code=err.status_code, headers=headers)


def from_validation_errors(errors: list[Any]) -> InvalidRequest:
    """pydantic's most telling complaint as a 400 naming the parameter (FastAPI would say
    422): the first field's, and of a union's, one about the value rather than a type."""
    if not errors:
        return InvalidRequest("invalid request")
    first = _most_telling(errors)
    param = _param_path(first.get("loc", ())) or None
    msg = _union_types(errors, first) or str(first.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    return InvalidRequest(f"{param}: {msg}" if param else msg, param=param)


# What a type complaint asks for, as a client reads JSON.
_TYPE_NAMES = {
    "string_type": "a string",
    "list_type": "a list",
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "dict_type": "an object",
    "model_type": "an object",
}


def _union_types(errors: list[Any], first: Any) -> str | None:
    """A value of the wrong type for a union field: every type its branches take (`input:
    123` said only "should be a valid list", while a string is valid too)."""
    if first.get("type") not in _TYPE_NAMES:
        return None
    field = _field(first.get("loc", ()))
    kinds = [
        _TYPE_NAMES[e.get("type")]
        for e in errors
        if e.get("type") in _TYPE_NAMES
        and _field(e.get("loc", ())) == field
        and tuple(e.get("loc", ()))[len(field) + 1 :] == ()
    ]
    wanted = list(dict.fromkeys(kinds))
    if len(wanted) < 2:
        return None
    return f"Input should be {', '.join(wanted[:-1])} or {wanted[-1]}"


def _most_telling(errors: list[Any]) -> Any:
    """A value of a union (`prompt`: text, token ids or lists of either) fails every branch,
    and pydantic lists the branches in order: `prompt: []` said "should be a valid string"
    (the text branch) where the token-id branches say "at least 1 item". Of the first
    field's complaints, the first about the value wins over those about a branch's type."""
    field = _field(errors[0].get("loc", ()))
    for error in errors:
        about_value = not str(error.get("type", "")).endswith("_type")
        if about_value and _field(error.get("loc", ())) == field:
            return error
    return errors[0]


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "constrained-str"}


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and ("[" in part or part in _UNION_TAGS)


def _field(loc: Any) -> tuple[Any, ...]:
    """The loc up to its first union tag: the field whose branches these are."""
    parts = tuple(loc)
    first_tag = next((i for i, part in enumerate(parts) if _is_union_tag(part)), len(parts))
    return parts[:first_tag]


def _param_path(loc: Any) -> str:
    """pydantic's loc as a client would write it: messages[0].role (union tags dropped)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part != "body" and not _is_union_tag(part):
            path += f".{part}" if path else str(part)
    return path


def from_http_exception(exc: StarletteHTTPException) -> ApiError:
    """The framework's own 404/405/413/... as one of ours, keeping its headers (Allow)."""
    kind: type[ApiError] = {404: NotFound, 405: MethodNotAllowed, 413: PayloadTooLarge}.get(
        exc.status_code, InvalidRequest if 400 <= exc.status_code < 500 else InternalError
    )
    return kind(str(exc.detail), headers=dict(exc.headers or {}))


# The methods a 405's Allow header may name.
HTTP_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def allowed_methods(request: Request) -> list[str]:
    """Every method some route of the path takes: the router's 405 names only the first
    route's (a path with a GET and a PUT route answered a DELETE with `Allow: GET`). Asked
    of the routes' own matching, as the router asks it (included routers too)."""
    return [
        method
        for method in HTTP_METHODS
        if any(
            route.matches({**request.scope, "method": method})[0] == Match.FULL
            for route in request.app.router.routes
        )
    ]


def install_handlers(app: FastAPI, log: logging.Logger) -> None:
    """Route every exception through `render` so clients only ever see OpenAI bodies."""

    def rid(request: Request) -> str | None:
        return getattr(request.state, "request_id", None)

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return render(exc, rid(request))

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return render(from_validation_errors(list(exc.errors())), rid(request))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        error = from_http_exception(exc)
        if exc.status_code == 405:
            error.headers["Allow"] = ", ".join(allowed_methods(request))
        return render(error, rid(request))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error", exc_info=exc)
        return render(InternalError("internal error; see the server log"), rid(request))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
