"""The embedded worker's HTTP server: vLLM's OpenAI-compatible API over the embedded Engine.

`create_app(settings, engine=None)` builds the app; its lifespan loads the engine in a thread
(GET /health answers 503 until then) and shuts it down. `serve(settings)` runs it under
uvicorn with a graceful SIGTERM: /health and new requests get 503, requests in flight get
`drain_timeout` seconds to finish, then whatever is left is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from engine.config import WorkerSettings
from engine.metrics import EngineStatsView, WorkerMetrics
from engine.protocol import ChatCompletionRequest, CompletionRequest
from engine.responses import Formatter, metrics_object, usage
from engine.serving import (
    ClientGone,
    Run,
    check_model,
    collect,
    finish_reason,
    guard_disconnect,
    prompt_ids,
    sampling_params,
    stream_events,
)
from service.errors import (
    AuthenticationFailed,
    InvalidRequest,
    PayloadTooLarge,
    Unavailable,
    from_validation_errors,
    install_handlers,
)

if TYPE_CHECKING:
    from engine.engine import Engine, EngineConfig

log = logging.getLogger("engine.server")
M = TypeVar("M", bound=BaseModel)


def engine_config(settings: WorkerSettings) -> EngineConfig:
    from engine.engine import EngineConfig

    spec = settings.speculative_config
    return EngineConfig(
        target_path=Path(settings.model),
        drafter_path=Path(spec.model) if spec is not None else None,
        num_speculative_tokens=spec.num_speculative_tokens if spec is not None else None,
        max_num_seqs=settings.max_num_seqs,
        max_model_len=settings.resolved_max_model_len(),
        max_waiting=settings.max_waiting,
        device=settings.device,
        dtype=settings.torch_dtype_name(),
        seed=settings.seed,
    )


def build_engine(settings: WorkerSettings) -> Engine:
    """Load tokenizer, target and drafter (slow; call from a thread)."""
    from engine.engine import Engine

    return Engine(engine_config(settings))


class WorkerState:
    """What the routes share: settings, the engine once loaded, drain flag, metrics."""

    def __init__(self, settings: WorkerSettings, engine: Engine | None) -> None:
        self.settings = settings
        self.engine = engine
        self.ready = False
        self.draining = False
        self.load_error: str | None = None
        self.on_fatal: Callable[[], None] | None = None
        self.metrics = WorkerMetrics(settings.model_name, self._stats)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shutdown: asyncio.Task[None] | None = None

    def _stats(self) -> EngineStatsView | None:
        return self.engine.stats() if self.ready and self.engine is not None else None

    async def load(self) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            if self.engine is None:
                self.engine = await asyncio.to_thread(build_engine, self.settings)
            await self.engine.start()
            self.ready = True
            log.info("worker ready: serving %s", self.settings.model_name)
        except Exception as exc:
            log.exception("the engine failed to load")
            self.load_error = f"{type(exc).__name__}: {exc}"
            if self.on_fatal is not None:
                self.on_fatal()

    def begin_drain(self) -> None:
        """SIGTERM: refuse new work now; in-flight requests get `drain_timeout` seconds,
        then the engine aborts them (their streams end with an in-band error)."""
        self.draining = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._start_engine_shutdown)

    def _start_engine_shutdown(self) -> None:
        if self._shutdown is None and self.engine is not None and self.ready:
            timeout = self.settings.drain_timeout
            self._shutdown = asyncio.ensure_future(self.engine.shutdown(drain_timeout=timeout))

    async def close(self, load_task: asyncio.Task[None]) -> None:
        self.draining = True
        if not load_task.done():
            load_task.cancel()  # the loading thread finishes on its own; nothing waits for it
            with contextlib.suppress(asyncio.CancelledError):
                await load_task
        self._start_engine_shutdown()
        if self._shutdown is not None:
            await self._shutdown
        self.ready = False


def create_app(settings: WorkerSettings, engine: Engine | None = None) -> FastAPI:
    """The worker app. Pass a constructed (not yet started) `engine` to skip loading."""
    state = WorkerState(settings, engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        load_task = asyncio.create_task(state.load())
        try:
            yield
        finally:
            await state.close(load_task)

    app = FastAPI(title="dflash-worker", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.worker = state
    install_handlers(app, log)
    _add_routes(app, state)
    return app


def _add_routes(app: FastAPI, state: WorkerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            raise Unavailable("the worker is shutting down", code="draining")
        if state.load_error is not None:
            raise Unavailable(f"the model failed to load: {state.load_error}", code="load_failed")
        if not state.ready:
            raise Unavailable("the model is loading", code="loading")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        _check_key(state, request)
        s = state.settings
        card = {"id": s.model_name, "object": "model", "created": 0,
                "owned_by": "dflash-serving", "root": s.model,
                "max_model_len": s.resolved_max_model_len()}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _complete(state, request, ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(state, request, CompletionRequest)


def _check_key(state: WorkerState, request: Request) -> None:
    key = state.settings.api_key
    if key is not None:
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise AuthenticationFailed("invalid or missing API key")


def _admit(state: WorkerState, request: Request) -> Engine:
    if state.draining:
        raise Unavailable("the worker is shutting down", code="draining")
    _check_key(state, request)
    if not state.ready or state.engine is None:
        raise Unavailable("the model is loading", code="loading")
    return state.engine


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object, refusing more than `limit` bytes (413) without reading it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the request body is {declared} bytes; the limit is {limit}")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise PayloadTooLarge(f"the request body exceeds the limit of {limit} bytes")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object")
    return data


def parse_body(model: type[M], data: dict[str, Any]) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_errors(list(exc.errors())) from None


async def _complete(
    state: WorkerState, request: Request, kind: type[ChatCompletionRequest | CompletionRequest]
) -> Response:
    is_chat = kind is ChatCompletionRequest
    request_id = f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}"
    request.state.request_id = request.headers.get("x-request-id") or request_id
    engine = _admit(state, request)
    req = parse_body(kind, await read_json(request, state.settings.max_body_bytes))
    check_model(req, state.settings.model_name)
    req.refuse_unsupported()
    ids = prompt_ids(engine, req)
    params = sampling_params(engine, req, ids)
    run = Run(engine, state.metrics, request_id, ids, params)
    run.start()  # QueueFull -> 503, RequestRejected -> 400, before any byte
    fmt = Formatter("chat" if is_chat else "completion", request_id, state.settings.model_name)
    headers = {"X-Request-Id": request.state.request_id}
    level = state.settings.per_request_spec_decode_metrics
    if req.stream:
        body = stream_events(request, run, fmt, req, level,
                             state.settings.enable_force_include_usage)
        return StreamingResponse(body, media_type="text/event-stream", headers=headers)
    try:
        text, last = await guard_disconnect(request, collect(run))
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; the generation is aborted
    finally:
        await run.close()
    use = usage(last.num_prompt_tokens, last.num_output_tokens)
    payload = fmt.response(text, finish_reason(last), use, metrics_object(last.metrics, level))
    return JSONResponse(payload, headers=headers)


class DrainingServer(uvicorn.Server):
    """uvicorn that flips the app into draining (503s) the moment SIGTERM arrives."""

    def __init__(self, config: uvicorn.Config, state: WorkerState) -> None:
        super().__init__(config)
        self._state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._state.begin_drain()
        super().handle_exit(sig, frame)


def serve(settings: WorkerSettings, *, log_level: str = "info") -> int:
    """Run the embedded worker until SIGTERM/SIGINT; returns the process exit code."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    app = create_app(settings)
    state: WorkerState = app.state.worker
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=log_level, lifespan="on",
        # Backstop only: the engine ends in-flight requests at drain_timeout itself.
        timeout_graceful_shutdown=int(settings.drain_timeout) + 10,
        access_log=log_level == "debug",
    )
    server = DrainingServer(config, state)
    state.on_fatal = lambda: setattr(server, "should_exit", True)
    started = time.monotonic()
    server.run()
    log.info("worker stopped after %.1fs", time.monotonic() - started)
    return 1 if state.load_error is not None else 0

