"""The bridge between the engine's step thread and asyncio.

`AsyncEngine.start()` runs `Engine.step()` back to back on a dedicated thread while there is
work, so the event loop that serves HTTP never waits on a forward pass; each step's outputs
are posted to the loop and routed to per-request queues. `generate()` queues a request at
once (refusals raise there, before any byte is sent) and streams its incremental outputs;
closing the stream aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import weakref
from collections.abc import AsyncGenerator, Callable
from typing import TypeVar

from engine.engine import Engine, EngineStats
from engine.errors import EngineError
from engine.sequence import RequestOutput, SamplingParams, Sequence
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
_T = TypeVar("_T")
Item = RequestOutput | BaseException


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # Streams live on the event loop; the step thread reaches them via _post only.
        self._queues: dict[int, asyncio.Queue[Item]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()  # new work or an abort for the step thread
        self._stepped = asyncio.Event()  # set after every dispatched step (drain waits)
        self._stopping = False

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def describe(self) -> str:
        return self.engine.describe()

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncGenerator[RequestOutput, None]:
        """Queue a request now (RequestRejected / QueueFull raise here) and stream its
        outputs. Closing or cancelling the iterator aborts the request."""
        if self._loop is None:
            raise RuntimeError("AsyncEngine.start() has not been awaited")
        seq = self.engine.add_request(request_id, prompt_token_ids, params)
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self._queues[id(seq)] = queue
        self._wake.set()
        stream = self._stream(seq, queue)
        # A stream dropped before its first `anext` never runs its `finally`: abort then.
        weakref.finalize(stream, self._abandon, seq)
        return stream

    def abort(self, seq: Sequence) -> None:
        self.engine.abort(seq)
        self._queues.pop(id(seq), None)
        self._wake.set()

    def _abandon(self, seq: Sequence) -> None:
        if not seq.finished and not seq.abort_requested:
            self.abort(seq)

    async def _stream(
        self, seq: Sequence, queue: asyncio.Queue[Item]
    ) -> AsyncGenerator[RequestOutput, None]:
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineError(f"request {seq.request_id} failed: {item}") from item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(seq)

    async def start(self) -> None:
        """Start the step thread."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stepped = asyncio.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        """The step thread: steps while there is work, sleeps on `_wake` otherwise."""
        while not self._stopping:
            self._wake.clear()
            if not self.engine.has_work:
                self._wake.wait()
                continue
            try:
                results = self.engine.step()
            except Exception as exc:  # a broken step must not hang every client
                logger.exception("engine step failed")
                self.engine.recover()
                self._post(self._fail_streams, exc)
                continue
            self._post(self._dispatch, results)

    def _post(self, callback: Callable[[_T], None], arg: _T) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback, arg)
        except RuntimeError:  # the event loop is gone: nobody is listening any more
            self._stopping = True

    def _dispatch(self, results: list[tuple[Sequence, RequestOutput]]) -> None:
        """On the event loop: route outputs to their streams."""
        for seq, out in results:
            queue = self._queues.get(id(seq))
            if queue is not None:
                queue.put_nowait(out)
                if out.finished:
                    del self._queues[id(seq)]
        self._stepped.set()

    def _fail_streams(self, exc: Exception) -> None:
        """On the event loop: every open stream raises EngineError."""
        for queue in self._queues.values():
            queue.put_nowait(exc)
        self._queues.clear()
        self._stepped.set()

    async def shutdown(self, drain_timeout: float) -> None:
        """Stop admitting, let running requests finish for up to `drain_timeout` seconds,
        then abort the rest (their streams end with finish_reason "abort")."""
        self.engine.accepting = False
        await self._wait_idle(max(0.0, drain_timeout))
        self.engine.abort_all()
        self._wake.set()
        await self._wait_idle(10.0)  # the step thread retires the aborted within a step
        self._stopping = True
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            await asyncio.to_thread(thread.join, 30.0)
        await asyncio.sleep(0)  # let the last posted outputs reach their streams

    async def _wait_idle(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while self.engine.has_work and self._thread is not None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._stepped.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stepped.wait(), remaining)
