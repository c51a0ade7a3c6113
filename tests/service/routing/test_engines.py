"""Every engine's per-request speculation reaches the same dflash_* series: unit checks of each
wire, then the real gateway in front of fake workers speaking each engine's shapes (taken from
each engine's source: tests/fixtures/engine_wires.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from service.reports import Usage
from service.routing.engines import WIRES
from tests.fixtures import engine_wires as shapes
from tests.service.conftest import Gateway, running_gateway
from tests.service.fake_upstream import SSE_HEAD, FakeWorker, Request, chunked, fake_worker, reply

ENGINES = ("vllm", "sglang", "trtllm")
USAGE = Usage(shapes.PROMPT_TOKENS, shapes.COMPLETION_TOKENS)


def test_each_wire_reads_the_same_generation() -> None:
    for engine in ENGINES:
        (stats,) = WIRES[engine].spec_stats(shapes.message(engine, "m"), USAGE)
        assert (stats.steps, stats.accepted_tokens) == (shapes.STEPS, shapes.ACCEPTED), engine
        assert stats.acceptance_length == pytest.approx(1 + shapes.ACCEPTED / shapes.STEPS)
        # TensorRT-LLM does not say how many tokens were drafted.
        expected = None if engine == "trtllm" else shapes.DRAFTED
        assert stats.draft_tokens == expected, engine


def test_sglang_is_asked_for_its_details_and_they_are_dropped_for_the_client() -> None:
    wire = WIRES["sglang"]
    asked = json.loads(wire.request_body(b'{"model":"m","messages":[]}'))
    assert asked["return_spec_tokens_details"] is True
    own = json.loads(wire.request_body(b'{"model":"m","return_spec_tokens_details":false}'))
    assert own["return_spec_tokens_details"] is False  # the client's own choice stands
    body = shapes.message("sglang", "m")
    raw = json.dumps(body).encode()
    assert "sglext" not in json.loads(wire.strip(raw, body, asked=False))
    assert wire.strip(raw, body, asked=True) == raw
    other = {**body, "sglext": {"spec_tokens_details": {}, "cached_tokens_details": {"x": 1}}}
    kept = json.loads(wire.strip(json.dumps(other).encode(), other, asked=False))
    assert kept["sglext"] == {"cached_tokens_details": {"x": 1}}
    events = shapes.stream_events("sglang", "m")
    assert [wire.extra_event(e) for e in events] == [False] * 4 + [True, False]
    assert WIRES["trtllm"].request_body(b'{"a":1}') == b'{"a":1}'  # it refuses unknown fields


def test_sglangs_error_bodies_take_openais_shape() -> None:
    """SGLang's ErrorResponse is top level (read from 0.5.23's protocol.py; tests/e2e/
    test_sglang_cpu.py sees it from the real server); OpenAI's clients read `error`."""
    sglang = WIRES["sglang"]
    body = (
        b'{"object":"error","message":"The input (3011 tokens) is longer than the model\'s '
        b'context length (1024 tokens).","type":"BadRequestError","param":null,"code":400}'
    )
    assert json.loads(sglang.error_body(body)) == {
        "error": {
            "message": "The input (3011 tokens) is longer than the model's context length "
            "(1024 tokens).",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }
    openai_shaped = b'{"error":{"message":"x","type":"t","param":null,"code":400}}'
    for kept in (openai_shaped, b"not json", b"[1]", b'{"detail":"x"}'):
        assert sglang.error_body(kept) == kept
    for engine in ("vllm", "trtllm"):
        assert WIRES[engine].error_body(body) == body  # relayed as the engine sent it


def test_malformed_or_missing_speculation_is_skipped_never_raised() -> None:
    for engine in ENGINES:
        wire = WIRES[engine]
        for body in (
            {},
            {"choices": None},
            {"sglext": "x"},
            {"choices": [{"avg_decoded_tokens_per_iter": "4"}]},
        ):
            assert wire.spec_stats(body, USAGE) == []
    assert WIRES["trtllm"].spec_stats(shapes.message("trtllm", "m"), None) == []
    plain = {"sglext": {"spec_tokens_details": {**shapes.SGLANG_DETAILS, "spec_verify_ct": 0}}}
    assert WIRES["sglang"].spec_stats(plain, USAGE) == []
    listed = {"sglext": {"spec_tokens_details": [shapes.SGLANG_DETAILS, shapes.SGLANG_DETAILS]}}
    assert len(WIRES["sglang"].spec_stats(listed, USAGE)) == 2  # n > 1: one per choice


def engine_handler(engine: str) -> Any:
    async def handle(request: Request, writer: asyncio.StreamWriter) -> None:
        payload = json.loads(request.body)
        if engine == "trtllm" and "return_spec_tokens_details" in payload:
            writer.write(reply("400 Bad Request", b'{"error":{"message":"extra field"}}'))
            return
        details = engine != "sglang" or payload.get("return_spec_tokens_details") is True
        if payload.get("stream"):
            events = shapes.stream_events(engine, payload["model"])
            if not details:
                events = [e for e in events if "sglext" not in e]
            writer.write(SSE_HEAD + chunked(shapes.sse(events)) + b"0\r\n\r\n")
            return
        body = shapes.message(engine, payload["model"])
        if not details:
            body.pop("sglext", None)
        writer.write(reply("200 OK", json.dumps(body).encode()))

    return handle


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[Gateway, dict[str, FakeWorker]]]:
    with ExitStack() as stack:
        workers = {e: stack.enter_context(fake_worker(engine_handler(e))) for e in ENGINES}
        pools = [
            {"name": e, "model": "fake", "engine": e, "weight": 1, "workers": [workers[e].url]}
            for e in ENGINES
        ]
        gateway = stack.enter_context(running_gateway(pools=pools))
        yield gateway, workers


def chat(gateway: Gateway, **extra: Any) -> httpx.Response:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], **extra}
    return httpx.post(gateway.v1 + "/chat/completions", json=body, timeout=30)


def test_the_same_request_fills_the_same_series_on_every_engine(
    fleet: tuple[Gateway, dict[str, FakeWorker]],
) -> None:
    gateway, workers = fleet
    answered: dict[str, list[dict[str, Any]]] = {e: [] for e in ENGINES}
    for stream in (False, True) * 3:  # round robin over the three pools, twice each
        answer = chat(gateway, stream=stream)
        assert answer.status_code == 200, answer.text
        pool = answer.headers["x-dflash-pool"]
        answered[pool].append({"stream": stream, "text": answer.text})
        assert "sglext" not in answer.text  # the gateway's own ask, not the client's
        if pool == "trtllm":  # it refuses unknown fields: nothing is added for it
            assert b"return_spec_tokens_details" not in workers["trtllm"].seen[-1].body
    assert all(len(v) == 2 for v in answered.values()), {k: len(v) for k, v in answered.items()}
    for engine in ENGINES:
        steps = gateway.metric("dflash_spec_steps_total", pool=engine)
        accepted = gateway.metric("dflash_spec_accepted_tokens_total", pool=engine)
        assert (steps, accepted) == (2 * shapes.STEPS, 2 * shapes.ACCEPTED), engine
        # The acceptance-length histogram: two observations of 4.0 in every pool.
        assert gateway.metric("dflash_spec_acceptance_length_count", pool=engine) == 2
        assert gateway.metric("dflash_spec_acceptance_length_sum", pool=engine) == pytest.approx(
            8.0
        )
        assert gateway.metric("dflash_spec_acceptance_length_bucket", pool=engine, le="3.5") == 0
        assert gateway.metric("dflash_spec_acceptance_length_bucket", pool=engine, le="4.0") == 2
    for engine in ("vllm", "sglang"):
        assert gateway.metric("dflash_spec_draft_tokens_total", pool=engine) == 2 * shapes.DRAFTED
        assert gateway.metric("dflash_spec_draft_acceptance_rate_count", pool=engine) == 2
    assert gateway.metric("dflash_spec_draft_tokens_total", pool="trtllm") == 0
    assert gateway.metric("dflash_spec_draft_acceptance_rate_count", pool="trtllm") == 0


def test_a_client_that_asks_sglang_for_details_gets_them(
    fleet: tuple[Gateway, dict[str, FakeWorker]],
) -> None:
    gateway, _ = fleet
    seen = set()
    for _ in range(3):
        answer = chat(gateway, return_spec_tokens_details=True)
        pool = answer.headers["x-dflash-pool"]
        seen.add(pool)
        if pool == "sglang":
            details = answer.json()["sglext"]["spec_tokens_details"]
            assert details["spec_verify_ct"] == shapes.STEPS
        elif pool == "trtllm":
            assert answer.status_code == 400  # TensorRT-LLM refuses the field: relayed as is
    assert seen == set(ENGINES)
