"""One request through the engine: prompt preparation, the output loop, disconnects, SSE.

Kept apart from server.py (routes and lifecycle) so each reads in one screen. Everything
a client can get wrong becomes a ApiError here, before the engine sees the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import Request

from engine.metrics import WorkerMetrics
from engine.protocol import ChatCompletionRequest, CompletionRequest
from engine.responses import SSE_DONE, Formatter, metrics_object, sse, usage
from engine.scheduler import QueueFull, RequestRejected
from engine.sequence import RequestOutput, SamplingParams
from service.errors import (
    ApiError,
    InternalError,
    InvalidRequest,
    ModelNotFound,
    Unavailable,
)

if TYPE_CHECKING:
    from engine.engine import Engine

T = TypeVar("T")
AnyRequest = ChatCompletionRequest | CompletionRequest


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


def check_model(req: AnyRequest, served: str) -> None:
    if req.model is not None and req.model != served:
        raise ModelNotFound(f"the model `{req.model}` does not exist (this worker serves "
                            f"`{served}`)", param="model")


def prompt_ids(engine: Engine, req: AnyRequest) -> list[int]:
    tok = engine.tokenizer
    if isinstance(req, ChatCompletionRequest):
        messages = req.template_messages()
        try:
            ids = tok.apply_chat_template(messages)
        except Exception as exc:  # the template's own raise_exception, jinja errors
            raise InvalidRequest(f"messages: rejected by the chat template: {exc}",
                                 param="messages") from None
    else:
        prompt = req.single_prompt()
        ids = tok.encode(prompt) if isinstance(prompt, str) else prompt  # ids: engine checks
    if not ids:
        raise InvalidRequest("prompt: must not be empty", param="prompt")
    return list(ids)


def _max_tokens(req: AnyRequest) -> tuple[str, int | None]:
    """(the field the client used, its value); chat's max_completion_tokens wins."""
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return "max_completion_tokens", req.max_completion_tokens
    return "max_tokens", req.max_tokens


def sampling_params(engine: Engine, req: AnyRequest, ids: list[int]) -> SamplingParams:
    limit = engine.max_model_len
    param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    if len(ids) >= limit:
        raise InvalidRequest(
            f"{param}: the prompt has {len(ids)} tokens; this model's maximum context length "
            f"is {limit} tokens (prompt plus completion)", param=param,
            code="context_length_exceeded")
    name, asked = _max_tokens(req)
    if asked is not None and asked < 1:
        raise InvalidRequest(f"{name}: must be at least 1, got {asked}", param=name)
    if asked is not None and len(ids) + asked > limit:
        raise InvalidRequest(
            f"{name}: {asked} tokens plus the {len(ids)}-token prompt exceed this model's "
            f"maximum context length of {limit} tokens", param=name,
            code="context_length_exceeded")
    return SamplingParams(
        max_tokens=asked if asked is not None else limit - len(ids),
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None or req.top_k < 0 else req.top_k,
        seed=req.seed,
        stop=req.stop_list(),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
    )


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

    def __init__(self, engine: Engine, metrics: WorkerMetrics, request_id: str,
                 ids: list[int], params: SamplingParams) -> None:
        self._engine, self._metrics = engine, metrics
        self._args = (request_id, ids, params)
        self._it: AsyncIterator[RequestOutput] | None = None
        self._last_token_at: float | None = None
        self._arrival = time.monotonic()
        self.last: RequestOutput | None = None
        self._closed = False  # close() ran: the abort is counted once

    def start(self) -> None:
        """Admit the request now, so engine refusals become 400/503 before any byte is sent."""
        try:
            self._it = self._engine.generate(*self._args)
        except QueueFull as exc:
            raise Unavailable(f"the worker is full: {exc}", code="queue_full") from None
        except RequestRejected as exc:
            raise InvalidRequest(exc.message, param=exc.param) from None

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
        self._metrics.observe_finished(ttft, max(0.0, end - m.arrival_time),
                                       out.finish_reason or "abort")

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
        raise Unavailable("the request was aborted: the worker is shutting down",
                          code="aborted")
    return out.finish_reason


async def collect(run: Run) -> tuple[str, RequestOutput]:
    parts: list[str] = []
    async for out in run.outputs():
        parts.append(out.text_delta)
    assert run.last is not None
    return "".join(parts), run.last


async def _outputs_watching_the_client(request: Request, run: Run) -> AsyncIterator[RequestOutput]:
    # The first output may wait for a free slot: a client that leaves meanwhile is noticed
    # here (afterwards, the next write to its socket fails and closes this stream).
    yield await guard_disconnect(request, run.next())
    async for out in run.outputs():
        yield out


async def stream_events(request: Request, run: Run, fmt: Formatter, req: AnyRequest,
                        level: str, force_usage: bool) -> AsyncIterator[bytes]:
    """SSE body: content chunks, the usage chunk with `metrics`, then [DONE]."""
    opts = req.stream_options
    include_usage = force_usage or bool(opts and opts.include_usage)
    continuous = force_usage or bool(include_usage and opts and opts.continuous_usage_stats)
    is_first = True
    try:
        async for out in _outputs_watching_the_client(request, run):
            if not out.text_delta and not out.finished and not is_first:
                continue
            chunk: dict[str, Any] = fmt.chunk(
                out.text_delta, finish_reason(out) if out.finished else None, first=is_first)
            is_first = False
            if continuous:
                chunk["usage"] = usage(out.num_prompt_tokens, out.num_output_tokens)
            yield sse(chunk)
        last = run.last
        if include_usage and last is not None:
            use = usage(last.num_prompt_tokens, last.num_output_tokens)
            yield sse(fmt.usage_chunk(use, metrics_object(last.metrics, level)))
    except ClientGone:
        return  # nobody to tell; `finally` has aborted the generation
    except ApiError as err:
        yield err.sse()
    except Exception:
        yield InternalError("internal error during generation; see the worker log").sse()
    finally:
        await run.close()
    yield SSE_DONE
