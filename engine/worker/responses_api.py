"""POST /v1/responses on the embedded worker: the conversation becomes chat messages and runs
the chat path (the same template, generation and per-request `metrics`), answered as a
`response` object or its typed events (responses_wire.py).

The worker keeps no state: `store: true` and `previous_response_id` are the gateway's (it
stores responses and sends the whole conversation with `store: false`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from engine.worker.fields import asks_nothing
from engine.worker.formatting import metrics_object
from engine.worker.generate import Choice, ClientGone, collect, finish_reason, merged_outputs
from engine.worker.responses_wire import ResponseFormatter, response_usage
from engine.worker.schemas import ChatCompletionRequest
from wire.errors import (
    ApiError,
    ClientClosedRequest,
    InvalidRequest,
    ModelNotFound,
    from_validation_errors,
)
from wire.http import read_json
from wire.refused import RESPONSES_REFUSED, RESPONSES_TEXT_FORMATS, VLLM
from wire.responses import ResponsesRequest, chat_messages

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.worker.state import WorkerState

# Read and honoured (`user` as in chat: an end-user id for the caller's own records).
HONOURED = frozenset(
    {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream"}
    | {"metadata", "text", "user", "stop"}
)


def check_response_fields(req: ResponsesRequest, payload: dict[str, Any]) -> None:
    for name, value in payload.items():
        rule = RESPONSES_REFUSED.get(name)
        if rule is not None and not asks_nothing(value, rule.off):
            raise InvalidRequest(f"{name}: {rule.why}", param=name)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type not in RESPONSES_TEXT_FORMATS:
        raise InvalidRequest(f"text.format: {fmt.type} is {VLLM}", param="text.format")
    if req.text is not None and req.text.verbosity is not None:
        raise InvalidRequest(
            "text.verbosity: the bundled models have one verbosity", param="text.verbosity"
        )


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion this response runs as (its validation errors renamed)."""
    chat: dict[str, Any] = {"messages": chat_messages(req.instructions, req.input_items())}
    for ours, theirs in (
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("stop", "stop"),
    ):
        value = getattr(req, ours)
        if value is not None:
            chat[theirs] = value
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        raise renamed(from_validation_errors(list(exc.errors()))) from None


# Chat's field names in the chat path's refusals, as the client named them here.
RENAMED = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens"}


def renamed(error: InvalidRequest) -> InvalidRequest:
    param = error.param or ""
    if param.startswith("messages"):
        param = "input"
    param = RENAMED.get(param, param)
    message = error.message
    for old, new in (*RENAMED.items(), ("messages", "input")):
        message = message.replace(old, new)
    return InvalidRequest(message, param=param or None, code=error.code)


async def read_request(state: WorkerState, request: Request) -> ResponsesRequest:
    _, payload = await read_json(request, state.settings.max_body_bytes)
    try:
        req = ResponsesRequest.model_validate(payload)
    except ValidationError as exc:
        raise from_validation_errors(list(exc.errors())) from None
    served = state.settings.model_name
    if req.model != served:
        raise ModelNotFound(
            f"The model `{req.model}` does not exist (this worker serves `{served}`).",
            param="model",
        )
    check_response_fields(req, payload)
    return req


# api.py's admission of one chat request into the engine: (engine, state, request, id).
Start = Callable[
    ["AsyncEngine", "WorkerState", ChatCompletionRequest, str], Awaitable[list[Choice]]
]


async def create_response(
    state: WorkerState, request: Request, engine: AsyncEngine, start: Start
) -> Response:
    """The handler's body, after admission (api.py sets the request id and admits)."""
    req = await read_request(state, request)
    try:
        choices = await start(engine, state, chat_request(req), "resp_" + request.state.request_id)
    except InvalidRequest as error:
        raise renamed(error) from None
    fmt = ResponseFormatter(req, "resp_" + request.state.request_id, state.settings.model_name)
    headers = {"X-Request-Id": request.state.request_id}
    level = state.settings.per_request_spec_decode_metrics
    if req.stream:
        body = response_events(request, choices[0], fmt, level)
        return StreamingResponse(body, media_type="text/event-stream", headers=headers)
    try:
        (whole,) = await collect(request, choices)
    except ClientGone:
        raise ClientClosedRequest("the client closed the connection") from None
    finally:
        await choices[0].run.close()
    done = final_response(fmt, choices[0], whole.text, whole.last, level, stream=False)
    return JSONResponse(done, headers=headers)


def final_response(
    fmt: ResponseFormatter, choice: Choice, text: str, last: Any, level: str, *, stream: bool
) -> dict[str, Any]:
    reason = finish_reason(last)
    use = response_usage(choice.prompt_tokens, last.num_output_tokens)
    body = fmt.response("completed", [fmt.message(text, "completed")], use, finish=reason)
    if body["status"] == "incomplete":
        body["output"][0]["status"] = "incomplete"
    if last.metrics is not None:
        body["metrics"] = metrics_object(last.metrics, level, stream=stream)
    return body


async def response_events(
    request: Request, choice: Choice, fmt: ResponseFormatter, level: str
) -> AsyncIterator[bytes]:
    """The typed events; an engine failure after the first byte ends with response.failed."""
    yield fmt.opening()
    parts: list[str] = []
    try:
        async for _, out in merged_outputs(request, [choice]):
            if out.text_delta:
                parts.append(out.text_delta)
                yield fmt.delta(out.text_delta)
            if out.finished:
                whole = final_response(fmt, choice, "".join(parts), out, level, stream=True)
                yield fmt.closing(whole)
    except ClientGone:
        return
    except ApiError as err:
        yield fmt.failed("server_error", err.message)
    except Exception:
        yield fmt.failed("server_error", "internal error during generation; see the worker log")
    finally:
        await choice.run.close()
