"""One request through the engine: the output loop, client disconnects, the SSE body.

Everything a client can get wrong was refused before this point (api.py); what can still go
wrong here is the engine shutting down or failing, which ends a stream in-band.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import Request

from engine.sequence import RequestOutput, SamplingParams, TokenLogprob
from engine.worker.formatting import CompletionFormatter, metrics_object, usage
from engine.worker.metrics import WorkerMetrics
from engine.worker.schemas import AnyRequest
from engine.worker.tracing import WorkerTrace
from wire.errors import ApiError, InternalError, Unavailable
from wire.http import SSE_DONE, sse_event

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
    left = True
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        left = not task.done()
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    # Not `task.cancelled()`: a cancelled gather (what `collect` passes) ends with a
    # CancelledError set as its exception, and does not count as cancelled.
    if left:
        raise ClientGone()
    return task.result()


class Run:
    """One request's engine iterator plus its Prometheus observations."""

    def __init__(
        self,
        engine: AsyncEngine,
        metrics: WorkerMetrics,
        request_id: str,
        trace: WorkerTrace | None = None,
        index: int = 0,
    ) -> None:
        self._engine, self._metrics, self._request_id = engine, metrics, request_id
        self._trace, self._index = trace, index
        self._it: AsyncIterator[RequestOutput] | None = None
        self._last_token_at: float | None = None
        self._arrival = time.monotonic()
        self.last: RequestOutput | None = None
        self._closed = False  # close() ran: the abort is counted once

    def start(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue the request (the engine's QueueFull / RequestRejected raise here)."""
        self._it = self._engine.generate(self._request_id, prompt_ids, params)
        if self._trace is not None:
            self._trace.track()

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
        if self._trace is not None:
            self._trace.sequence_done(out, self._index)

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
        if self._trace is not None:
            self._trace.sequence_done(self.last, self._index)


def finish_reason(out: RequestOutput) -> str:
    if out.finish_reason == "abort" or out.finish_reason is None:
        raise Unavailable("the request was aborted: the worker is shutting down", code="aborted")
    return out.finish_reason


# A logprobs entry: a scored token, or the id of a token nothing scores (the prompt's first).
Entry = TokenLogprob | int


@dataclass
class Choice:
    """One sequence of a request: n per prompt, one or more prompts."""

    index: int  # the choice's index in the response
    run: Run
    echo: str  # text that goes before the completion (the prompt, with `echo`)
    prompt_tokens: int
    counts_prompt: bool  # the first choice of its prompt: its prompt counts in usage
    first_prompt_token: int | None = None  # with echo and logprobs: the unscored entry
    hide_output: bool = False  # echo with max_tokens 0: the one generated token is not shown

    def shown(self, out: RequestOutput, first: bool) -> tuple[str, list[Entry] | None]:
        """What the client sees of an output: the echoed prompt (and its logprobs) before
        the first, the generated text and logprobs unless hidden."""
        text = "" if self.hide_output else out.text_delta
        entries: list[Entry] | None = None
        if out.logprobs_delta is not None:
            entries = [] if self.hide_output else list(out.logprobs_delta)
        if first and out.prompt_logprobs is not None and self.first_prompt_token is not None:
            entries = [self.first_prompt_token, *out.prompt_logprobs, *(entries or [])]
        return (self.echo + text if first else text), entries


def choices_usage(choices: list[Choice], lasts: list[RequestOutput | None]) -> dict[str, int]:
    """vLLM's usage for several choices: each prompt counted once, every completion."""
    prompt = sum(c.prompt_tokens for c in choices if c.counts_prompt)
    completion = sum(o.num_output_tokens for o in lasts if o is not None)
    return usage(prompt, completion)


@dataclass(frozen=True)
class Whole:
    """A choice's whole answer as shown (echo included): text, logprobs (when asked for),
    and its final output."""

    text: str
    logprobs: list[Entry] | None
    last: RequestOutput


async def _whole(choice: Choice) -> Whole:
    parts: list[str] = []
    logprobs: list[Entry] | None = None
    async for out in choice.run.outputs():
        text, entries = choice.shown(out, first=not parts)
        parts.append(text)
        if entries is not None:
            logprobs = (logprobs or []) + entries
    assert choice.run.last is not None
    return Whole("".join(parts), logprobs, choice.run.last)


async def collect(request: Request, choices: list[Choice]) -> list[Whole]:
    """Every choice's whole answer; ClientGone when the client leaves first."""
    work = asyncio.gather(*(_whole(c) for c in choices))
    return await guard_disconnect(request, work)


async def merged_outputs(
    request: Request, choices: list[Choice]
) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """The choices' outputs as they come, interleaved. The first wait may be for a free
    slot: a client that leaves meanwhile is noticed (afterwards, the next write to its socket
    fails and closes this stream)."""
    pending = {asyncio.ensure_future(c.run.next()): c for c in choices}
    first = True
    try:
        while pending:
            wait = asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            done, _ = await (guard_disconnect(request, wait) if first else wait)
            first = False
            for task in done:
                choice = pending.pop(task)
                out = task.result()
                if not out.finished:
                    pending[asyncio.ensure_future(choice.run.next())] = choice
                yield choice, out
    finally:
        # Cancelled reads must end before the runs close: an engine stream cannot be
        # closed while a read of it is still under way.
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


async def stream_events(
    request: Request,
    choices: list[Choice],
    fmt: CompletionFormatter,
    req: AnyRequest,
    level: str,
    force_usage: bool,
) -> AsyncIterator[bytes]:
    """SSE body: per choice a role chunk (chat) and its content chunks, interleaved; then the
    usage chunk (with `metrics` for a single choice) when asked; then [DONE]."""
    opts = req.stream_options
    include_usage = force_usage or bool(opts and opts.include_usage)
    continuous = force_usage or bool(include_usage and opts and opts.continuous_usage_stats)
    opened: set[int] = set()
    lasts: dict[int, RequestOutput] = {}
    try:
        async for choice, out in merged_outputs(request, choices):
            lasts[choice.index] = out
            first = choice.index not in opened
            if first:
                opened.add(choice.index)
                if fmt.endpoint == "chat":
                    yield sse_event(fmt.role_chunk(choice.index))
            text, entries = choice.shown(out, first)
            if not (text or out.finished or entries):
                continue
            reason = finish_reason(out) if out.finished else None
            chunk: dict[str, Any] = fmt.chunk(text, reason, out.stop_reason, choice.index, entries)
            if continuous:
                chunk["usage"] = choices_usage(choices, [lasts.get(c.index) for c in choices])
            yield sse_event(chunk)
        if include_usage:
            use = choices_usage(choices, [lasts.get(c.index) for c in choices])
            single = lasts[choices[0].index].metrics if len(choices) == 1 else None
            body_metrics = None if single is None else metrics_object(single, level, stream=True)
            yield sse_event(fmt.usage_chunk(use, body_metrics))
    except ClientGone:
        return  # nobody to tell; `finally` has aborted the generation
    except ApiError as err:
        yield err.sse()
        return
    except Exception:
        yield InternalError("internal error during generation; see the worker log").sse()
        return
    finally:
        for choice in choices:
            await choice.run.close()
    yield SSE_DONE
