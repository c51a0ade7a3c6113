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
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

from engine.worker.api import router
from engine.worker.metrics import EngineStatsView, WorkerMetrics
from engine.worker.settings import WorkerSettings
from service.auth import ApiKeyAuth
from service.errors import install_handlers
from service.http import DrainingServer, run_servers

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

log = logging.getLogger("engine.worker")


def engine_config(settings: WorkerSettings) -> EngineConfig:
    from engine.config import EngineConfig

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
        adaptive=settings.adaptive_speculation,
        drafter_int8=settings.drafter_int8,
    )


def build_engine(settings: WorkerSettings) -> AsyncEngine:
    """Load tokenizer, target and drafter (slow; call from a thread)."""
    from engine.async_engine import AsyncEngine
    from engine.engine import Engine

    return AsyncEngine(Engine(engine_config(settings)))


class WorkerState:
    """What the routes share: settings, the engine once loaded, drain flag, metrics."""

    def __init__(self, settings: WorkerSettings, engine: AsyncEngine | None) -> None:
        self.settings = settings
        self.engine = engine
        self.auth = ApiKeyAuth(list(settings.api_key), protect_metrics=False)
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


def create_app(settings: WorkerSettings, engine: AsyncEngine | None = None) -> FastAPI:
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
    started = time.monotonic()
    run_servers([server])
    log.info("worker stopped after %.1fs", time.monotonic() - started)
    return 1 if state.load_error is not None else 0
