"""The worker's HTTP surface: OpenAI endpoints, models, probes and metrics.

A completion request goes: admit (draining? key? loaded?) -> read and validate the body
(wire/http.py, engine/worker/schemas.py) -> tokens and sampling parameters -> the engine
(generate.py) -> a JSON body or an SSE stream (formatting.py). This module is the only place
where engine exceptions become HTTP errors.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar, cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from engine.errors import QueueFull, RequestRejected
from engine.sequence import SamplingParams
from engine.worker.fields import check_fields
from engine.worker.formatting import CompletionFormatter, metrics_object
from engine.worker.generate import (
    Choice,
    ClientGone,
    Run,
    choices_usage,
    collect,
    finish_reason,
    stream_events,
)
from engine.worker.responses_api import create_response
from engine.worker.schemas import (
    AnyRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from engine.worker.tracing import WorkerTrace
from wire.errors import (
    ApiError,
    AuthenticationFailed,
    ClientClosedRequest,
    InvalidRequest,
    ModelNotFound,
    Unavailable,
    from_validation_errors,
)
from wire.http import client_request_id, package_version, read_json

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.worker.state import WorkerState
    from wire.otel import Tracing

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
        # n x prompts past it are refused (_start): the gateway's /openapi.json bounds n by it.
        "max_sequences_per_request": s.max_num_seqs + s.max_waiting,
    }
    if state.ready and state.engine is not None:
        # Token ids at or past it are refused: the gateway's /openapi.json bounds them by it.
        card["vocab_size"] = state.engine.engine.vocab_size
    return {"object": "list", "data": [card]}


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str) -> dict[str, Any]:
    state = worker(request)
    _check_key(state, request)
    card = (await models(request))["data"][0]
    if model_id != card["id"]:
        raise ModelNotFound(f"The model `{model_id}` does not exist.", param="model")
    return dict(card)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": package_version()}


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    state = worker(request)
    engine = _admit(state, request)
    req, _ = await _read(state, request, TokenizeRequest)
    tok = engine.tokenizer
    special = req.special_tokens()
    if req.messages is not None:
        ids = list(tok.apply_chat_template(req.template_messages(), add_special_tokens=special))
    else:
        ids = list(tok.encode(req.prompt or "", add_special_tokens=special))
    return {
        "count": len(ids),
        "max_model_len": engine.max_model_len,
        "tokens": ids,
        "token_strs": tok.token_strings(ids) if req.return_token_strs else None,
    }


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, str]:
    state = worker(request)
    engine = _admit(state, request)
    req, _ = await _read(state, request, DetokenizeRequest)
    vocab = engine.engine.vocab_size
    if any(t >= vocab for t in req.tokens):
        raise InvalidRequest(f"tokens: token ids must be in [0, {vocab})", param="tokens")
    return {"prompt": engine.tokenizer.decode(req.tokens)}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(worker(request).metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/chat/completions")
async def chat(request: Request) -> Response:
    return await _complete(worker(request), request, ChatCompletionRequest)


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    state = worker(request)
    given = client_request_id(request.scope["headers"])
    request.state.request_id = given or uuid.uuid4().hex
    if state.tracing is None:
        return await create_response(state, request, _admit(state, request), _start)
    trace = _trace(state.tracing, state, request)
    try:
        engine = _admit(state, request)
        return await create_response(state, request, engine, partial(_start, trace=trace))
    except ApiError as error:
        trace.failed(error.status_code, error.code or error.error_type, error.message)
        raise


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _complete(worker(request), request, CompletionRequest)


def _check_key(state: WorkerState, request: Request) -> None:
    if state.auth.enabled and not state.auth.allows_headers(request.scope["headers"]):
        raise AuthenticationFailed()


def _admit(state: WorkerState, request: Request) -> AsyncEngine:
    if state.draining:
        raise Unavailable("the worker is shutting down", code="draining")
    _check_key(state, request)
    if not state.ready or state.engine is None:
        raise Unavailable("the model is loading", code="loading")
    return state.engine


R = TypeVar(
    "R", bound=ChatCompletionRequest | CompletionRequest | TokenizeRequest | DetokenizeRequest
)


async def _read(state: WorkerState, request: Request, kind: type[R]) -> tuple[R, dict[str, Any]]:
    """The body as `kind` (and as parsed JSON), for the model this worker serves."""
    _, payload = await read_json(request, state.settings.max_body_bytes)
    try:
        req = cast(R, kind.model_validate(payload))  # pydantic's Self is lost on a bound union
    except ValidationError as exc:
        raise from_validation_errors(list(exc.errors())) from None
    served = state.settings.model_name
    if req.model is not None and req.model != served:
        raise ModelNotFound(
            f"The model `{req.model}` does not exist (this worker serves `{served}`).",
            param="model",
        )
    return req, payload


def _prompts(engine: AsyncEngine, req: AnyRequest) -> list[tuple[list[int], str]]:
    """Each prompt of the request as (token ids, its text for `echo`)."""
    tok = engine.tokenizer
    if isinstance(req, ChatCompletionRequest):
        try:
            options = req.template_options()
            return [(list(tok.apply_chat_template(req.template_messages(), **options)), "")]
        except InvalidRequest:
            raise
        except Exception as exc:  # the template's own raise_exception, jinja errors
            raise InvalidRequest(
                f"messages: rejected by the chat template: {exc}", param="messages"
            ) from None
    out: list[tuple[list[int], str]] = []
    for prompt in req.prompts():
        if isinstance(prompt, str):
            out.append(
                (list(tok.encode(prompt, add_special_tokens=req.add_special_tokens)), prompt)
            )
        else:
            vocab = engine.engine.vocab_size
            if any(not 0 <= t < vocab for t in prompt):  # decode() below needs real ids
                raise InvalidRequest(f"prompt: token ids must be in [0, {vocab})", param="prompt")
            out.append((prompt, tok.decode(prompt)))
    return out


# OpenAI's and vLLM's default for completions; chat runs to the context limit.
COMPLETION_MAX_TOKENS = 16


def _sampling_params(req: AnyRequest) -> SamplingParams:
    _, max_tokens = req.max_tokens_field()
    prompt_logprobs = None
    if isinstance(req, CompletionRequest):
        if max_tokens is None:
            max_tokens = COMPLETION_MAX_TOKENS
        if max_tokens == 0:  # echo only (schemas.py): one token is generated and not shown
            max_tokens = 1
        prompt_logprobs = req.logprobs if req.echo else None
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None or req.top_k < 0 else req.top_k,
        seed=req.seed,
        stop=req.stop_list(),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=req.logit_bias_pairs(),
        min_tokens=req.min_tokens,
        bad_words=tuple(req.bad_words or ()),
        allowed_token_ids=None if req.allowed_token_ids is None else tuple(req.allowed_token_ids),
        logprobs=req.num_logprobs(),
        prompt_logprobs=prompt_logprobs,
    )


def _refusal(req: AnyRequest, exc: RequestRejected) -> InvalidRequest:
    param = exc.param
    if param == "max_tokens":
        param = req.max_tokens_field()[0]
    elif param == "prompt" and isinstance(req, ChatCompletionRequest):
        param = "messages"
    return InvalidRequest(exc.message, param=param, code=exc.code)


async def _start(
    engine: AsyncEngine,
    state: WorkerState,
    req: AnyRequest,
    request_id: str,
    trace: WorkerTrace | None = None,
) -> list[Choice]:
    """Admit every choice (n per prompt) into the engine now: refusals are 400/503 before
    any byte, and a refusal withdraws the choices already admitted."""
    params = _sampling_params(req)
    n = req.n or 1
    prompts = _prompts(engine, req)
    capacity = state.settings.max_num_seqs + state.settings.max_waiting
    if n * len(prompts) > capacity:  # could never be queued whole: not a retry-later 503
        raise InvalidRequest(
            f"n: {n} choices for {len(prompts)} prompt(s) are {n * len(prompts)} sequences; "
            f"this worker holds at most {capacity} at once",
            param="n" if n > 1 else "prompt",
        )
    if trace is not None:
        trace.usage(n * sum(len(ids) for ids, _ in prompts))
    choices: list[Choice] = []
    try:
        for i, (ids, text) in enumerate(prompts):
            for j in range(n):
                # n samples of one prompt must differ; a seed keeps them reproducible.
                seeded = params if params.seed is None else replace(params, seed=params.seed + j)
                run = Run(engine, state.metrics, request_id, trace, i * n + j)
                run.start(ids, seeded)
                echoed = isinstance(req, CompletionRequest) and bool(req.echo)
                choices.append(
                    Choice(
                        i * n + j,
                        run,
                        text if echoed else "",
                        len(ids),
                        j == 0,
                        first_prompt_token=ids[0] if params.prompt_logprobs is not None else None,
                        hide_output=echoed and req.max_tokens == 0,
                    )
                )
    except (QueueFull, RequestRejected) as exc:
        for choice in choices:
            await choice.run.close()
        if isinstance(exc, QueueFull):
            raise Unavailable(f"the worker is full: {exc}", code="queue_full") from None
        raise _refusal(req, exc) from None
    return choices


async def _complete(state: WorkerState, request: Request, kind: type[AnyRequest]) -> Response:
    """The request under its server span when tracing is on (docs/tracing.md)."""
    if state.tracing is None:
        return await _generate(state, request, kind, None)
    trace = _trace(state.tracing, state, request)
    try:
        return await _generate(state, request, kind, trace)
    except ApiError as error:
        trace.failed(error.status_code, error.code or error.error_type, error.message)
        raise


def _trace(tracing: Tracing, state: WorkerState, request: Request) -> WorkerTrace:
    """The request's server span, continuing the gateway's traceparent."""
    path, model = request.url.path, state.settings.model_name
    return WorkerTrace(tracing, path, model, request.scope["headers"])


async def _generate(
    state: WorkerState, request: Request, kind: type[AnyRequest], trace: WorkerTrace | None
) -> Response:
    is_chat = kind is ChatCompletionRequest
    given = client_request_id(request.scope["headers"])
    request.state.request_id = given or uuid.uuid4().hex
    # As vLLM: the client's X-Request-Id becomes the body's id.
    request_id = f"{'chatcmpl' if is_chat else 'cmpl'}-{request.state.request_id}"
    engine = _admit(state, request)
    req, payload = await _read(state, request, kind)
    check_fields(payload, "chat" if is_chat else "completion")
    choices = await _start(engine, state, req, request_id, trace)
    fmt = CompletionFormatter(
        "chat" if is_chat else "completion",
        request_id,
        state.settings.model_name,
        name_token=engine.tokenizer.logprob_token,
    )
    headers = {"X-Request-Id": request.state.request_id}
    level = state.settings.per_request_spec_decode_metrics
    if req.stream:
        force_usage = state.settings.enable_force_include_usage
        body = stream_events(request, choices, fmt, req, level, force_usage)
        return StreamingResponse(body, media_type="text/event-stream", headers=headers)
    try:
        finals = await collect(request, choices)
    except ClientGone:
        raise ClientClosedRequest("the client closed the connection") from None
    finally:
        for choice in choices:
            await choice.run.close()
    bodies = [
        fmt.choice(c.index, w.text, finish_reason(w.last), w.last.stop_reason, w.logprobs)
        for c, w in zip(choices, finals, strict=True)
    ]
    use = choices_usage(choices, [w.last for w in finals])
    # Per-request metrics describe one sequence: only for a single choice, as vLLM.
    single = finals[0].last.metrics if len(choices) == 1 else None
    body_metrics = None if single is None else metrics_object(single, level, stream=False)
    return JSONResponse(fmt.body(bodies, use, body_metrics), headers=headers)
