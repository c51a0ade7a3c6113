"""The embedded worker's application: vLLM's OpenAI-compatible API over the engine core.

`create_app(settings, engine=None)` builds the app; its lifespan loads the engine in a thread
(GET /health answers 503 until then) and shuts it down. `serve(settings)` runs it under
uvicorn with a graceful SIGTERM: /health and new requests get 503, requests in flight get
`drain_timeout` seconds to finish, then whatever is left is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

from engine.worker.api import router
from engine.worker.settings import WorkerSettings
from engine.worker.state import WorkerState
from wire.errors import install_handlers
from wire.http import DrainingServer, run_servers, tune_gc_for_serving
from wire.tracing import WORKER_SERVICE, open_tracing

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine

log = logging.getLogger("engine.worker")


def create_app(settings: WorkerSettings, engine: AsyncEngine | None = None) -> FastAPI:
    """The worker app. Pass a constructed (not yet started) `engine` to skip loading."""
    state = WorkerState(settings, engine, open_tracing(settings.tracing, WORKER_SERVICE))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        load_task = asyncio.create_task(state.load())
        try:
            yield
        finally:
            await state.close(load_task)
            if state.tracing is not None:
                await asyncio.to_thread(state.tracing.shutdown)  # flush, bounded by its timeout

    app = FastAPI(title="dflash-worker", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.worker = state
    install_handlers(app, log)
    app.include_router(router)
    return app


def serve(settings: WorkerSettings, *, log_level: str = "info") -> int:
    """Run the embedded worker until SIGTERM/SIGINT; returns the process exit code."""
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from engine.threads import configure_torch_threads, serving_threads

    requested = settings.threads
    if requested is None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        requested = int(os.environ["OMP_NUM_THREADS"])  # what the launcher sized for us
    threads = configure_torch_threads(serving_threads() if requested is None else requested)
    log.info("torch threads: %d", threads)
    app = create_app(settings)
    state: WorkerState = app.state.worker
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        lifespan="on",
        # Backstop only: the engine ends in-flight requests at drain_timeout itself.
        timeout_graceful_shutdown=int(settings.drain_timeout) + 10,
        timeout_keep_alive=settings.http_keep_alive_s,
        access_log=log_level == "debug",
    )
    server = DrainingServer(config, state.begin_drain)
    state.on_fatal = lambda: setattr(server, "should_exit", True)
    # Once the engine is loaded, its weights' modules, the tokenizer's tables and the
    # calibration are never garbage: frozen, no collection walks them again. A step
    # allocates a few hundred objects (more when speculating: plans, per-request
    # estimates), and at CPython's defaults the step thread's collections walked the whole
    # start-up heap often enough to make the speculating worker's plain steps 2% dearer.
    state.on_ready = tune_gc_for_serving
    started = time.monotonic()
    run_servers([server])
    log.info("worker stopped after %.1fs", time.monotonic() - started)
    return 1 if state.load_error is not None else 0
