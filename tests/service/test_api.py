"""The OpenAI SDK against the gateway in front of a real embedded worker."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import httpx
import openai
import pytest

from tests.service.conftest import MODEL, Gateway, wait_until

MESSAGES: list[Any] = [{"role": "user", "content": "def fib(n):"}]


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0)


def test_chat_non_streaming_carries_usage_and_metrics(gateway: Gateway) -> None:
    reply = client(gateway).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
    spec = (reply.model_extra or {})["metrics"]["speculative_decoding"]
    assert spec["num_spec_tokens"] == 3


def test_extra_fields_reach_the_worker(gateway: Gateway) -> None:
    # ignore_eos is not OpenAI: only the worker understands it, so exactly 12 tokens prove it
    # passed through untouched.
    reply = client(gateway).completions.create(
        model=MODEL, prompt="import os", max_tokens=12, extra_body={"ignore_eos": True}
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 12


def test_stream_without_include_usage_has_no_usage_chunk(gateway: Gateway) -> None:
    chunks = list(
        client(gateway).chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, stream=True
        )
    )
    assert chunks and all(chunk.choices for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason in {"stop", "length"}


def test_stream_with_include_usage_ends_with_usage_and_metrics(gateway: Gateway) -> None:
    chunks = list(
        client(gateway).completions.create(
            model=MODEL,
            prompt="class Stack:",
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.model_extra or {})["metrics"]["speculative_decoding"]["num_spec_steps"] >= 1
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text


def test_metrics_reach_prometheus_with_the_values_clients_saw(gateway: Gateway) -> None:
    before = {n: gateway.metric(n, model=MODEL) for n in SERIES}
    seen = {n: 0.0 for n in SERIES}
    sdk = client(gateway)
    for _ in range(2):
        reply = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6)
        add_seen(seen, reply.model_dump())
    stream = sdk.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    add_seen(seen, [c for c in stream][-1].model_dump())

    def counted() -> dict[str, float]:
        return {n: gateway.metric(n, model=MODEL) - before[n] for n in SERIES}

    # A stream is counted when the gateway's relay ends, which may come just after the
    # client read [DONE]: wait (bounded) for it, then the totals must be exact.
    wait_until(lambda: counted()["dflash_completion_tokens_total"] >= seen[
        "dflash_completion_tokens_total"], timeout=20.0)  # fmt: skip
    assert counted() == seen
    assert gateway.metric("dflash_time_to_first_token_seconds_count", model=MODEL) >= 1
    assert gateway.metric("dflash_time_per_output_token_seconds_count", model=MODEL) >= 1
    assert gateway.metric("dflash_spec_acceptance_length_count", model=MODEL) >= 3
    assert gateway.metric("dflash_requests_total", model=MODEL, status="200") >= 3
    assert gateway.metric("dflash_worker_healthy") == 1


SERIES = {
    "dflash_prompt_tokens_total": ("usage", "prompt_tokens"),
    "dflash_completion_tokens_total": ("usage", "completion_tokens"),
    "dflash_spec_steps_total": ("spec", "num_spec_steps"),
    "dflash_spec_draft_tokens_total": ("spec", "num_draft_tokens"),
    "dflash_spec_accepted_tokens_total": ("spec", "num_accepted_draft_tokens"),
}


def add_seen(seen: dict[str, float], body: dict[str, Any]) -> None:
    spec = body["metrics"]["speculative_decoding"]
    for name, (where, key) in SERIES.items():
        seen[name] += (body["usage"] if where == "usage" else spec)[key]


def test_models_health_ready(gateway: Gateway) -> None:
    assert [m.id for m in client(gateway).models.list()] == [MODEL]
    assert httpx.get(gateway.base_url + "/health").status_code == 200
    ready = httpx.get(gateway.base_url + "/ready")
    assert ready.status_code == 200 and ready.json()["healthy_workers"] == 1


def test_request_id_is_echoed_or_generated(gateway: Gateway) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    given = httpx.post(
        gateway.v1 + "/chat/completions", json=body, headers={"X-Request-Id": "abc-123"}, timeout=30
    )
    assert given.headers["x-request-id"] == "abc-123"
    fresh = httpx.post(gateway.v1 + "/chat/completions", json=body, timeout=30)
    assert len(fresh.headers["x-request-id"]) == 32
    bad = httpx.get(gateway.base_url + "/nope", headers={"X-Request-Id": "bad id\t!"})
    assert bad.headers["x-request-id"] != "bad id\t!" and bad.status_code == 404


def test_exposition_passes_promtool(gateway: Gateway) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (make tools)")
    client(gateway).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    text = httpx.get(gateway.base_url + "/metrics").text
    assert "dflash_spec_acceptance_length_bucket" in text
    done = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_models_retrieve_version_tokenize_detokenize_are_routed(gateway: Gateway) -> None:
    sdk = client(gateway)
    assert sdk.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("nope")
    assert httpx.get(gateway.base_url + "/version").json()["version"] != "unknown"
    tok = httpx.post(
        gateway.base_url + "/tokenize", json={"model": MODEL, "prompt": "def f(x):"}, timeout=30
    ).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    back = httpx.post(
        gateway.base_url + "/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}, timeout=30
    ).json()
    assert back["prompt"] == "def f(x):"
    for path, body, status in [
        ("/tokenize", {"prompt": "x"}, 400),  # the gateway needs model
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404),
        ("/detokenize", {"model": MODEL, "tokens": [-1]}, 400),
    ]:
        r = httpx.post(gateway.base_url + path, json=body, timeout=30)
        assert r.status_code == status and r.json()["error"]["message"], (path, r.text)


def test_a_body_is_read_as_json_whatever_its_content_type(gateway: Gateway) -> None:
    """docs/api.md: curl's -d sends a form's Content-Type; the body is still JSON."""
    body = b'{"model": "%s", "prompt": "import os", "max_tokens": 2}' % MODEL.encode()
    for content_type in ("application/x-www-form-urlencoded", "text/plain"):
        reply = httpx.post(
            gateway.v1 + "/completions",
            content=body,
            headers={"Content-Type": content_type},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 2
