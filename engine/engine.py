"""The embedded engine: tokenizer, target, drafter, slot caches and the scheduler.

`step()` is one iteration of continuous batching and reads as schedule -> spec_step ->
commit: retire and admit (scheduler), prefill the admitted, run ONE speculative step over
every running sequence (speculative.spec_step), then commit each row's tokens through the
sequence's stop conditions. `start()` runs steps back to back on a dedicated thread while
there is work, so the event loop that serves HTTP never waits on a forward pass;
`generate()` streams each request's incremental outputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from engine.loader import load_drafter, load_target
from engine.scheduler import QueueFull, RequestRejected, ScheduledBatch, Scheduler
from engine.sequence import RequestOutput, SamplingParams, Sequence
from engine.speculative import DecodeRow, PrefillRow, RowSampling, SpecState, prefill, release
from engine.speculative import spec_step as run_spec_step
from engine.tokenizer import Tokenizer

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineStats",
    "QueueFull",
    "RequestRejected",
]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


@dataclass(frozen=True)
class EngineConfig:
    target_path: Path
    drafter_path: Path | None = None  # None = plain decoding
    num_speculative_tokens: int | None = None  # None = the drafter's block_size - 1
    max_num_seqs: int = 8
    max_model_len: int = 2048
    max_waiting: int = 64  # waiting-queue bound; beyond it: QueueFull
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0


class EngineError(RuntimeError):
    """A step failed inside the engine; the requests it was running are lost."""


@dataclass(frozen=True)
class EngineStats:
    """Load gauges and cumulative counters, named after the vLLM metrics they feed."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    num_spec_tokens: int  # 0 without a drafter
    num_drafts: int  # verify steps (one per running request per spec step)
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]  # len num_spec_tokens: steps that accepted draft i
    prompt_tokens: int
    generation_tokens: int
    num_requests_finished: int


@dataclass
class _Counters:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_requests_finished: int = 0


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _unique(seqs: Iterable[Sequence]) -> list[Sequence]:
    return list({id(s): s for s in seqs}.values())


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.max_model_len = config.max_model_len
        self.tokenizer = Tokenizer.from_dir(config.target_path)
        self._eos_ids = frozenset(self.tokenizer.eos_token_ids)
        dtype = _torch_dtype(config.dtype)
        target = load_target(config.target_path, config.device, dtype)
        drafter = None
        if config.drafter_path is not None:
            drafter = load_drafter(config.drafter_path, target, config.device, dtype)
        self.block_size = self._block_size(config, None if drafter is None else drafter.block_size)
        if self.block_size == 1:
            drafter = None  # zero speculative tokens is plain decoding
        self.num_spec_tokens: int | None = None if drafter is None else self.block_size - 1
        self.vocab_size: int = target.config.vocab_size
        self._state = SpecState.create(
            target,
            drafter,
            config.max_num_seqs,
            config.max_model_len,
            self.block_size,
            config.device,
            dtype,
        )
        self._scheduler = Scheduler(config.max_num_seqs, config.max_waiting)
        self._lock = threading.Lock()  # guards the scheduler between the loop and the step
        self._sampling: dict[int, RowSampling] = {}
        self._shared_generator = torch.Generator(device=config.device).manual_seed(config.seed)
        self._counters = _Counters(accepted_per_pos=[0] * (self.num_spec_tokens or 0))
        # Streams live on the event loop; the step thread reaches them via _post only.
        self._queues: dict[int, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()  # new work or an abort for the step thread
        self._stepped = asyncio.Event()  # set after every dispatched step (drain waits)
        self._accepting = True
        self._stopping = False

    @staticmethod
    def _block_size(config: EngineConfig, drafter_block: int | None) -> int:
        k = config.num_speculative_tokens
        if drafter_block is None:
            if k:
                raise ValueError("num_speculative_tokens needs a drafter")
            return 1
        if k is None:
            return drafter_block
        if not 0 <= k < drafter_block:
            raise ValueError(
                f"num_speculative_tokens must be in [0, {drafter_block - 1}] for a drafter "
                f"with block_size {drafter_block}, got {k}"
            )
        return k + 1

    # ---- requests -------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestRejected for a request that can never be served as asked."""
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestRejected("the prompt is empty: at least one token is needed", "prompt")
        if n >= self.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {n} tokens and leaves no room for the completion",
                "prompt",
            )
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise RequestRejected(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        _validate_params(params)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Sequence:
        """Validate and queue a request (the synchronous half of `generate`)."""
        if not self._accepting:
            raise QueueFull("the engine is shutting down")
        self.validate(prompt_token_ids, params)
        seq = Sequence(
            request_id,
            list(prompt_token_ids),
            params,
            detokenizer=self.tokenizer.detokenizer(prompt_token_ids),
            eos_token_ids=self._eos_ids,
            max_model_len=self.max_model_len,
            arrival_time=time.monotonic(),
            num_spec_tokens=self.num_spec_tokens,
        )
        with self._lock:
            self._sampling[id(seq)] = self._row_sampling(params)
            try:
                self._scheduler.add(seq)
            except QueueFull:
                del self._sampling[id(seq)]
                raise
        self._wake.set()
        return seq

    def _row_sampling(self, params: SamplingParams) -> RowSampling:
        if params.temperature == 0:
            return RowSampling(temperature=0.0)
        if params.seed is None:
            generator = self._shared_generator
        else:
            generator = torch.Generator(device=self.config.device).manual_seed(params.seed)
        return RowSampling(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            generator=generator,
        )

    def abort(self, seq: Sequence) -> None:
        """Stop a request; its slot is freed at the next step."""
        seq.abort_requested = True
        self._queues.pop(id(seq), None)
        self._wake.set()

    # ---- one step -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine iteration (blocking): schedule -> spec_step -> commit."""
        return [out for _, out in self._step()]

    def _step(self) -> list[tuple[Sequence, RequestOutput]]:
        with self._lock:
            batch = self._scheduler.schedule(time.monotonic())
        self._release(batch)
        if batch.prefill:
            self._prefill(batch.prefill)
        decode = [s for s in (*batch.decode, *batch.prefill) if not s.finished]
        if decode:
            self._decode(decode)
        with self._lock:
            done = self._scheduler.retire(time.monotonic())
        self._release(done)
        touched = _unique([*batch.retired, *batch.prefill, *batch.decode])
        return [(s, out) for s in touched if (out := s.take_output()) is not None]

    def _release(self, batch: ScheduledBatch) -> None:
        for slot in batch.freed_slots:
            release(self._state, slot)
        for seq in batch.retired:
            self._sampling.pop(id(seq), None)
            self._counters.num_requests_finished += 1

    def _prefill(self, seqs: list[Sequence]) -> None:
        rows = [PrefillRow(slot=_slot(s), token_ids=s.prompt_token_ids) for s in seqs]
        first = prefill(self._state, rows, [self._sampling[id(s)] for s in seqs])
        now = time.monotonic()
        counters = self._counters
        for seq, token in zip(seqs, first, strict=True):
            counters.prompt_tokens += seq.num_prompt_tokens
            counters.generation_tokens += seq.append((token,), now)

    def _decode(self, seqs: list[Sequence]) -> None:
        rows = [
            DecodeRow(slot=_slot(s), last_token=s.last_token, position=s.position) for s in seqs
        ]
        results = run_spec_step(self._state, rows, [self._sampling[id(s)] for s in seqs])
        now = time.monotonic()
        counters = self._counters
        for seq, result in zip(seqs, results, strict=True):
            counters.generation_tokens += seq.append(result.token_ids, now)
            spec = seq.metrics.spec
            if spec is None:
                continue
            spec.observe(result.num_drafted, result.num_accepted)
            counters.num_drafts += 1
            counters.num_draft_tokens += result.num_drafted
            counters.num_accepted_tokens += result.num_accepted
            for pos in range(result.num_accepted):
                counters.accepted_per_pos[pos] += 1

    # ---- asyncio face ---------------------------------------------------------------

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncGenerator[RequestOutput, None]:
        """Queue a request now (RequestRejected / QueueFull raise here) and stream its
        outputs. Closing or cancelling the iterator aborts the request."""
        if self._loop is None:
            raise RuntimeError("Engine.start() has not been awaited")
        seq = self.add_request(request_id, prompt_token_ids, params)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[id(seq)] = queue
        self._wake.set()
        stream = self._stream(seq, queue)
        # A stream dropped before its first `anext` never runs its `finally`: abort then.
        weakref.finalize(stream, self._abandon, seq)
        return stream

    def _abandon(self, seq: Sequence) -> None:
        if not seq.finished and not seq.abort_requested:
            self.abort(seq)

    async def _stream(
        self, seq: Sequence, queue: asyncio.Queue[RequestOutput | BaseException]
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
        """Start the step thread. It steps back to back while there is work and hands
        each step's outputs to the event loop, so it never waits on HTTP handling."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stepped = asyncio.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        """The step thread."""
        while not self._stopping:
            self._wake.clear()
            if not self._scheduler.has_work:
                self._wake.wait()
                continue
            try:
                results = self._step()
            except Exception as exc:  # a broken step must not hang every client
                logger.exception("engine step failed")
                self._abort_everything()
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

    def _abort_everything(self) -> None:
        """After a failed step (step thread): end every request and empty every slot."""
        with self._lock:
            self._scheduler.abort_all()
            batch = self._scheduler.retire(time.monotonic())
        self._release(batch)

    def _fail_streams(self, exc: Exception) -> None:
        """On the event loop: every open stream raises EngineError."""
        for queue in self._queues.values():
            queue.put_nowait(exc)
        self._queues.clear()
        self._stepped.set()

    async def shutdown(self, drain_timeout: float) -> None:
        """Stop admitting, let running requests finish for up to `drain_timeout` seconds,
        then abort the rest (their streams end with finish_reason "abort")."""
        self._accepting = False
        await self._wait_idle(max(0.0, drain_timeout))
        with self._lock:
            self._scheduler.abort_all()
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
        while self._scheduler.has_work and self._thread is not None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._stepped.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stepped.wait(), remaining)

    def stats(self) -> EngineStats:
        c = self._counters
        return EngineStats(
            num_running=self._scheduler.num_running,
            num_waiting=self._scheduler.num_waiting,
            kv_cache_usage=self._state.kv_cache_usage(),
            num_spec_tokens=self.num_spec_tokens or 0,
            num_drafts=c.num_drafts,
            num_draft_tokens=c.num_draft_tokens,
            num_accepted_tokens=c.num_accepted_tokens,
            accepted_per_pos=list(c.accepted_per_pos),
            prompt_tokens=c.prompt_tokens,
            generation_tokens=c.generation_tokens,
            num_requests_finished=c.num_requests_finished,
        )


def _slot(seq: Sequence) -> int:
    assert seq.slot is not None, "a scheduled sequence has a slot"
    return seq.slot


def _validate_params(params: SamplingParams) -> None:
    if params.max_tokens < 1:
        raise RequestRejected(
            f"max_tokens must be at least 1, got {params.max_tokens}", "max_tokens"
        )
    if not params.temperature >= 0:
        raise RequestRejected(f"temperature must be >= 0, got {params.temperature}", "temperature")
    if not 0 < params.top_p <= 1:
        raise RequestRejected(f"top_p must be in (0, 1], got {params.top_p}", "top_p")
    if params.top_k < 0:
        raise RequestRejected(f"top_k must be >= 0 (0 = off), got {params.top_k}", "top_k")
    if any(not s for s in params.stop):
        raise RequestRejected("stop strings must not be empty", "stop")
