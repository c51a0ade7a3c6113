"""One request through the engine: the output loop, client disconnects, the SSE body.

Everything a client can get wrong was refused before this point (api.py); what can still go
wrong here is the engine shutting down or failing, which ends a stream in-band.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import Request

from engine.sequence import RequestOutput, SamplingParams
from engine.worker.metrics import WorkerMetrics
from engine.worker.responses import Formatter, metrics_object, usage
from engine.worker.schemas import AnyRequest
from service.errors import ApiError, InternalError, Unavailable
from service.http import SSE_DONE, sse_event

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def guard_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work` unless the client leaves first: then cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()


class Run:
    """One request's engine iterator plus its Prometheus observations."""

    def __init__(self, engine: AsyncEngine, metrics: WorkerMetrics, request_id: str) -> None:
        self._engine, self._metrics, self._request_id = engine, metrics, request_id
        self._it: AsyncIterator[RequestOutput] | None = None
        self._last_token_at: float | None = None
        self._arrival = time.monotonic()
        self.last: RequestOutput | None = None
        self._closed = False  # close() ran: the abort is counted once

    def start(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue the request (the engine's QueueFull / RequestRejected raise here)."""
        self._it = self._engine.generate(self._request_id, prompt_ids, params)

    async def next(self) -> RequestOutput:
        assert self._it is not None, "Run.start() first"
        try:
            out = await anext(self._it)
        except StopAsyncIteration:
            raise InternalError("the engine ended the request without a final output") from None
        now = time.monotonic()
        if out.token_ids_delta:
            if self._last_token_at is not None:
                self._metrics.observe_itl(now - self._last_token_at)
            self._last_token_at = now
        self.last = out
        if out.finished:
            self._observe_finished(out, now)
        return out

    def _observe_finished(self, out: RequestOutput, now: float) -> None:
        m = out.metrics
        ttft = m.first_token_time - m.arrival_time if m.first_token_time is not None else None
        end = m.finished_time if m.finished_time is not None else now
        self._metrics.observe_finished(
            ttft, max(0.0, end - m.arrival_time), out.finish_reason or "abort"
        )

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        while self.last is None or not self.last.finished:
            yield await self.next()

    async def close(self) -> None:
        """Stop the generation if it is still running (the engine frees the slot)."""
        if self._closed or self._it is None or (self.last is not None and self.last.finished):
            return
        self._closed = True
        aclose = getattr(self._it, "aclose", None)
        if aclose is not None:
            await aclose()
        self._metrics.observe_finished(None, time.monotonic() - self._arrival, "abort")


def finish_reason(out: RequestOutput) -> str:
    if out.finish_reason == "abort" or out.finish_reason is None:
        raise Unavailable("the request was aborted: the worker is shutting down", code="aborted")
    return out.finish_reason


async def _text(run: Run) -> tuple[str, RequestOutput]:
    parts = [out.text_delta async for out in run.outputs()]
    assert run.last is not None
    return "".join(parts), run.last


async def collect(request: Request, run: Run) -> tuple[str, RequestOutput]:
    """The whole text and the final output; ClientGone when the client leaves first."""
    return await guard_disconnect(request, _text(run))


async def _outputs_watching_the_client(request: Request, run: Run) -> AsyncIterator[RequestOutput]:
    # The first output may wait for a free slot: a client that leaves meanwhile is noticed
    # here (afterwards, the next write to its socket fails and closes this stream).
    yield await guard_disconnect(request, run.next())
    async for out in run.outputs():
        yield out


async def _prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    yield first
    async for item in rest:
        yield item


async def stream_events(
    request: Request, run: Run, fmt: Formatter, req: AnyRequest, level: str, force_usage: bool
) -> AsyncIterator[bytes]:
    """SSE body: content chunks, the usage chunk with `metrics`, then [DONE]."""
    opts = req.stream_options
    include_usage = force_usage or bool(opts and opts.include_usage)
    continuous = force_usage or bool(include_usage and opts and opts.continuous_usage_stats)
    try:
        outputs = _outputs_watching_the_client(request, run)
        first = await anext(outputs)
        if fmt.endpoint == "chat":
            yield sse_event(fmt.role_chunk())
        async for out in _prepend(first, outputs):
            if not out.text_delta and not out.finished:
                continue
            reason = finish_reason(out) if out.finished else None
            chunk: dict[str, Any] = fmt.chunk(out.text_delta, reason, out.stop_reason)
            if continuous:
                chunk["usage"] = usage(out.num_prompt_tokens, out.num_output_tokens)
            yield sse_event(chunk)
        last = run.last
        if include_usage and last is not None:
            use = usage(last.num_prompt_tokens, last.num_output_tokens)
            yield sse_event(fmt.usage_chunk(use, metrics_object(last.metrics, level, stream=True)))
    except ClientGone:
        return  # nobody to tell; `finally` has aborted the generation
    except ApiError as err:
        yield err.sse()
        return
    except Exception:
        yield InternalError("internal error during generation; see the worker log").sse()
        return
    finally:
        await run.close()
    yield SSE_DONE
