"""The asyncio bridge on tiny random checkpoints: streams, queueing, cancellation, dropped
streams, rejection before the first byte, a failing step, shutdown."""

from __future__ import annotations

import asyncio
import gc
from dataclasses import replace

import pytest

from engine.async_engine import AsyncEngine
from engine.errors import EngineError, QueueFull, RequestRejected
from engine.sequence import SamplingParams, Sequence
from engine.speculative import RowResult
from tests.engine.test_engine import (
    GREEDY,
    ckpt,
    make_engine,
    one_torch_thread,
    reference,
    requests,
)
from tests.fixtures.tiny_models import TinyCheckpoint

__all__ = ["ckpt", "one_torch_thread", "reference", "requests"]  # fixtures shared with test_engine


@pytest.mark.anyio
async def test_queue_full_when_slots_and_queue_are_taken(ckpt: TinyCheckpoint) -> None:
    engine = AsyncEngine(make_engine(ckpt, max_num_seqs=1, max_waiting=1))
    await engine.start()
    try:
        long = replace(GREEDY, max_tokens=100)
        streams = [engine.generate(str(i), [3, 4, 5], long) for i in range(2)]
        with pytest.raises(QueueFull):
            engine.generate("2", [3, 4, 5], long)
        for s in streams:
            await s.aclose()
    finally:
        await engine.shutdown(drain_timeout=0)


@pytest.mark.anyio
async def test_closing_or_cancelling_a_stream_frees_the_slot(ckpt: TinyCheckpoint) -> None:
    engine = AsyncEngine(make_engine(ckpt, k=3, max_num_seqs=1, max_waiting=4))
    await engine.start()
    try:
        long = replace(GREEDY, max_tokens=120)
        stream = engine.generate("a", [3, 4, 5], long)
        first = await anext(stream)
        assert not first.finished and first.token_ids_delta
        await stream.aclose()

        async def consume() -> None:
            async for _ in engine.generate("b", [3, 4, 5], long):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Both aborted: the only slot serves the next request to its end.
        outs = [o async for o in engine.generate("c", [3, 4, 5], replace(GREEDY, max_tokens=5))]
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert sum(len(o.token_ids_delta) for o in outs) == 5
        assert engine.stats().num_running == 0
    finally:
        await engine.shutdown(drain_timeout=0)


@pytest.mark.anyio
async def test_bad_requests_are_rejected_with_the_parameter(ckpt: TinyCheckpoint) -> None:
    engine = AsyncEngine(make_engine(ckpt, max_model_len=16))
    await engine.start()
    cases = [
        ([], GREEDY, "prompt", "empty"),
        (list(range(16)), GREEDY, "prompt", "maximum context length is 16"),
        ([1, 2], replace(GREEDY, max_tokens=0), "max_tokens", "at least 1"),
        ([1, 2], replace(GREEDY, max_tokens=-3), "max_tokens", "got -3"),
        ([1, 2], replace(GREEDY, temperature=-1.0), "temperature", ">= 0"),
        ([1, 2], replace(GREEDY, top_p=0.0), "top_p", "(0, 1]"),
        ([engine.engine.vocab_size], GREEDY, "prompt", "token ids"),
    ]
    try:
        for prompt, params, param, text in cases:
            with pytest.raises(RequestRejected) as err:
                engine.generate("x", prompt, params)
            assert err.value.param == param and text in err.value.message
        assert engine.stats().num_waiting == 0
    finally:
        await engine.shutdown(drain_timeout=0)


@pytest.mark.anyio
async def test_stream_text_matches_tokens_and_stop_string_truncates(ckpt: TinyCheckpoint) -> None:
    engine = AsyncEngine(make_engine(ckpt, k=3))
    await engine.start()
    try:
        prompt = [21, 22, 23]
        outs = [o async for o in engine.generate("a", prompt, replace(GREEDY, max_tokens=20))]
        tokens = [t for o in outs for t in o.token_ids_delta]
        text = "".join(o.text_delta for o in outs)
        assert text == engine.tokenizer.decode(tokens).rstrip("\ufffd")
        stop = text[5:8]
        params = replace(GREEDY, max_tokens=20, stop=(stop,))
        outs = [o async for o in engine.generate("b", prompt, params)]
        assert "".join(o.text_delta for o in outs) == text[: text.index(stop)]
        assert outs[-1].finish_reason == "stop"
    finally:
        await engine.shutdown(drain_timeout=0)


@pytest.mark.anyio
async def test_shutdown_aborts_what_does_not_drain(ckpt: TinyCheckpoint) -> None:
    engine = AsyncEngine(make_engine(ckpt, max_num_seqs=1))
    await engine.start()
    stream = engine.generate("a", [3, 4], replace(GREEDY, max_tokens=120))
    await anext(stream)
    await engine.shutdown(drain_timeout=0.0)
    rest = [o async for o in stream]
    assert rest and rest[-1].finished and rest[-1].finish_reason == "abort"
    with pytest.raises(QueueFull, match="shutting down"):
        engine.generate("b", [3, 4], GREEDY)


@pytest.mark.anyio
async def test_concurrent_streams_match_the_reference(
    ckpt: TinyCheckpoint,
    requests: list[tuple[list[int], SamplingParams]],
    reference: dict[str, list[int]],
) -> None:
    engine = AsyncEngine(make_engine(ckpt, k=3, max_num_seqs=3))
    await engine.start()

    async def one(i: int) -> list[int]:
        await asyncio.sleep(0.002 * i)  # staggered arrivals
        prompt, params = requests[i]
        return [t async for o in engine.generate(str(i), prompt, params) for t in o.token_ids_delta]

    try:
        got = await asyncio.gather(*(one(i) for i in range(8)))
    finally:
        await engine.shutdown(drain_timeout=1.0)
    assert got == [reference[str(i)] for i in range(8)]


@pytest.mark.anyio
async def test_a_failing_step_fails_its_streams_and_the_engine_goes_on(
    ckpt: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = AsyncEngine(make_engine(ckpt, k=3))
    real_decode = engine.engine.runner.decode
    calls = {"n": 0}

    def flaky(seqs: list[Sequence]) -> list[RowResult]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real_decode(seqs)

    monkeypatch.setattr(engine.engine.runner, "decode", flaky)
    await engine.start()
    try:
        with pytest.raises(EngineError, match="boom"):
            async for _ in engine.generate("a", [3, 4, 5], replace(GREEDY, max_tokens=50)):
                pass
        assert engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0
        outs = [o async for o in engine.generate("b", [3, 4, 5], GREEDY)]
        assert outs[-1].finish_reason == "length"
    finally:
        await engine.shutdown(drain_timeout=0)


@pytest.mark.anyio
async def test_a_stream_dropped_unread_frees_its_slot(ckpt: TinyCheckpoint) -> None:
    engine = AsyncEngine(make_engine(ckpt, max_num_seqs=1, max_waiting=0, max_model_len=8192))
    await engine.start()
    try:
        stream = engine.generate("a", [3, 4], replace(GREEDY, max_tokens=8000))
        del stream
        gc.collect()
        for _ in range(200):  # the step thread retires it at its next step
            if engine.stats().num_running + engine.stats().num_waiting == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().num_requests_finished == 1
        outs = [o async for o in engine.generate("b", [3, 4], replace(GREEDY, max_tokens=3))]
        assert outs[-1].finish_reason == "length"
    finally:
        await engine.shutdown(drain_timeout=0)
