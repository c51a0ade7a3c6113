"""The worker's HTTP surface: OpenAI endpoints, models, probes and metrics.

A completion request goes: admit (draining? key? loaded?) -> read and validate the body
(service/http.py, engine/worker/schemas.py) -> tokens and sampling parameters -> the engine
(generate.py) -> a JSON body or an SSE stream (responses.py). This module is the only place
where engine exceptions become HTTP errors.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from engine.errors import QueueFull, RequestRejected
from engine.sequence import SamplingParams
from engine.worker.generate import ClientGone, Run, collect, finish_reason, stream_events
from engine.worker.responses import Formatter, metrics_object, usage
from engine.worker.schemas import AnyRequest, ChatCompletionRequest, CompletionRequest
from service.errors import (
    AuthenticationFailed,
    ClientClosedRequest,
    InvalidRequest,
    ModelNotFound,
    Unavailable,
    from_validation_errors,
)
from service.http import client_request_id, read_json

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.worker.app import WorkerState

router = APIRouter()


def worker(request: Request) -> WorkerState:
    state: WorkerState = request.app.state.worker
    return state


@router.get("/health")
async def health(request: Request) -> Response:
    state = worker(request)
    if state.draining:
        raise Unavailable("the worker is shutting down", code="draining")
    if state.load_error is not None:
        raise Unavailable(f"the model failed to load: {state.load_error}", code="load_failed")
    if not state.ready:
        raise Unavailable("the model is loading", code="loading")
    return Response(status_code=200)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    state = worker(request)
    _check_key(state, request)
    s = state.settings
    card = {
        "id": s.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "dflash-serving",
        "root": s.model,
        "max_model_len": s.resolved_max_model_len(),
    }
    return {"object": "list", "data": [card]}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(worker(request).metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/chat/completions")
async def chat(request: Request) -> Response:
    return await _complete(worker(request), request, ChatCompletionRequest)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _complete(worker(request), request, CompletionRequest)


def _check_key(state: WorkerState, request: Request) -> None:
    if state.auth.enabled and not state.auth.allows_headers(request.scope["headers"]):
        raise AuthenticationFailed("invalid or missing API key")


def _admit(state: WorkerState, request: Request) -> AsyncEngine:
    if state.draining:
        raise Unavailable("the worker is shutting down", code="draining")
    _check_key(state, request)
    if not state.ready or state.engine is None:
        raise Unavailable("the model is loading", code="loading")
    return state.engine


def _parse(kind: type[AnyRequest], payload: dict[str, Any]) -> AnyRequest:
    try:
        return kind.model_validate(payload)
    except ValidationError as exc:
        raise from_validation_errors(list(exc.errors())) from None


def _check_model(req: AnyRequest, served: str) -> None:
    if req.model is not None and req.model != served:
        raise ModelNotFound(
            f"The model `{req.model}` does not exist (this worker serves `{served}`).",
            param="model",
        )


def _prompt_ids(engine: AsyncEngine, req: AnyRequest) -> list[int]:
    tok = engine.tokenizer
    if isinstance(req, ChatCompletionRequest):
        try:
            return list(tok.apply_chat_template(req.template_messages()))
        except InvalidRequest:
            raise
        except Exception as exc:  # the template's own raise_exception, jinja errors
            raise InvalidRequest(
                f"messages: rejected by the chat template: {exc}", param="messages"
            ) from None
    prompt = req.single_prompt()
    return list(tok.encode(prompt)) if isinstance(prompt, str) else prompt


# OpenAI's and vLLM's default for completions; chat runs to the context limit.
COMPLETION_MAX_TOKENS = 16


def _sampling_params(req: AnyRequest) -> SamplingParams:
    _, max_tokens = req.max_tokens_field()
    if max_tokens is None and isinstance(req, CompletionRequest):
        max_tokens = COMPLETION_MAX_TOKENS
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None or req.top_k < 0 else req.top_k,
        seed=req.seed,
        stop=req.stop_list(),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
    )


def _start(engine: AsyncEngine, state: WorkerState, req: AnyRequest, request_id: str) -> Run:
    """Admit the request into the engine now: refusals are 400/503 before any byte."""
    params = _sampling_params(req)
    run = Run(engine, state.metrics, request_id)
    try:
        run.start(_prompt_ids(engine, req), params)
    except QueueFull as exc:
        raise Unavailable(f"the worker is full: {exc}", code="queue_full") from None
    except RequestRejected as exc:
        param = exc.param
        if param == "max_tokens":
            param = req.max_tokens_field()[0]
        elif param == "prompt" and isinstance(req, ChatCompletionRequest):
            param = "messages"
        raise InvalidRequest(exc.message, param=param, code=exc.code) from None
    return run


async def _complete(state: WorkerState, request: Request, kind: type[AnyRequest]) -> Response:
    is_chat = kind is ChatCompletionRequest
    given = client_request_id(request.scope["headers"])
    request.state.request_id = given or uuid.uuid4().hex
    # As vLLM: the client's X-Request-Id becomes the body's id.
    request_id = f"{'chatcmpl' if is_chat else 'cmpl'}-{request.state.request_id}"
    engine = _admit(state, request)
    _, payload = await read_json(request, state.settings.max_body_bytes)
    req = _parse(kind, payload)
    _check_model(req, state.settings.model_name)
    req.refuse_unsupported()
    run = _start(engine, state, req, request_id)
    fmt = Formatter("chat" if is_chat else "completion", request_id, state.settings.model_name)
    headers = {"X-Request-Id": request.state.request_id}
    level = state.settings.per_request_spec_decode_metrics
    if req.stream:
        force_usage = state.settings.enable_force_include_usage
        body = stream_events(request, run, fmt, req, level, force_usage)
        return StreamingResponse(body, media_type="text/event-stream", headers=headers)
    try:
        text, last = await collect(request, run)
    except ClientGone:
        raise ClientClosedRequest("the client closed the connection") from None
    finally:
        await run.close()
    use = usage(last.num_prompt_tokens, last.num_output_tokens)
    body_metrics = metrics_object(last.metrics, level, stream=False)
    payload = fmt.response(text, finish_reason(last), last.stop_reason, use, body_metrics)
    return JSONResponse(payload, headers=headers)
