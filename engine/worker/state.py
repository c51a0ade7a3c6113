"""What the embedded worker's routes share: settings, the engine once loaded (it loads in a
thread after the server starts), the drain flag, the metrics. Apart from the app (which
builds it) and the routes (which read it), so neither imports the other."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.worker.metrics import EngineStatsView, WorkerMetrics
from engine.worker.settings import WorkerSettings
from wire.bearer import BearerKeys

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from wire.otel import Tracing

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


def adaptation(settings: WorkerSettings) -> dict[str, Any] | None:
    """The manifest `dflash-train adapt` wrote beside the drafter, when it is an adapted one."""
    spec = settings.speculative_config
    path = Path(spec.model) / "manifest.json" if spec is not None else None
    if path is None or not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("the drafter's %s cannot be read (%s): no adaptation metrics", path, exc)
        return None
    return manifest if isinstance(manifest, dict) else None


class WorkerState:
    """What the routes share: settings, the engine once loaded, drain flag, metrics."""

    def __init__(
        self, settings: WorkerSettings, engine: AsyncEngine | None, tracing: Tracing | None = None
    ) -> None:
        self.settings = settings
        self.tracing = tracing  # OpenTelemetry, when on (docs/tracing.md)
        self.engine = engine
        self.auth = BearerKeys(settings.api_key)
        self.ready = False
        self.draining = False
        self.load_error: str | None = None
        self.on_fatal: Callable[[], None] | None = None
        self.on_ready: Callable[[], None] | None = None  # the engine loaded and started
        self.metrics = WorkerMetrics(settings.model_name, self._stats, adaptation(settings))
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
            if self.on_ready is not None:
                self.on_ready()
            self.ready = True
            log.info(
                "worker ready: serving %s (%s)", self.settings.model_name, self.engine.describe()
            )
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
