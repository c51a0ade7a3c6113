"""Proxy behaviour with real workers: spreading, failover, in-band errors, recovery,
client disconnects reaching the worker, and 503 when nothing is healthy."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

import httpx
import openai

from service.routing.fleet import worker_id
from tests.fixtures.worker import WorkerHandle, free_port
from tests.service.conftest import (
    MODEL,
    Gateway,
    running_gateway,
    scrape,
    wait_until,
    worker_args,
    worker_on_port,
)

CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
LONG = {"max_tokens": 900, "ignore_eos": True}  # seconds of work for the tiny worker


def prompts_seen(worker: WorkerHandle) -> float:
    return scrape(worker.base_url, "vllm:prompt_tokens_total")


def running(worker: WorkerHandle) -> float:
    return scrape(worker.base_url, "vllm:num_requests_running")


def test_no_healthy_worker_is_503_with_retry_after() -> None:
    with running_gateway(workers=[f"http://127.0.0.1:{free_port()}"]) as gw:
        reply = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "max_tokens": 2})
        assert reply.status_code == 503
        assert reply.headers["retry-after"] == "1"
        assert reply.json()["error"]["code"] == "no_healthy_worker"
        assert httpx.get(gw.base_url + "/ready").status_code == 503
        assert httpx.get(gw.base_url + "/health").status_code == 200
        assert gw.metric("dflash_worker_healthy") == 0


def test_disconnect_cancels_a_streaming_request(gateway: Gateway, worker: WorkerHandle) -> None:
    generated = scrape(worker.base_url, "vllm:generation_tokens_total")
    body = {**CHAT, **LONG, "stream": True}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", gateway.v1 + "/chat/completions", json=body) as reply,
    ):
        chunks = reply.iter_raw()  # kept referenced: a dropped generator closes the stream
        next(chunks)
        assert running(worker) == 1
    wait_until(lambda: running(worker) == 0, timeout=10)
    time.sleep(0.3)
    assert scrape(worker.base_url, "vllm:generation_tokens_total") - generated < 900
    wait_until(lambda: gateway.metric("dflash_requests_total", status="499") >= 1)


def test_disconnect_cancels_a_non_streaming_request(gateway: Gateway, worker: WorkerHandle) -> None:
    generated = scrape(worker.base_url, "vllm:generation_tokens_total")
    payload = httpx.Request("POST", "/", json={**CHAT, **LONG}).read()
    port = int(gateway.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\n\r\n"
        )
        sock.sendall(head.encode() + payload)
        wait_until(lambda: running(worker) == 1, timeout=10)
    wait_until(lambda: running(worker) == 0, timeout=10)
    time.sleep(0.3)
    assert scrape(worker.base_url, "vllm:generation_tokens_total") - generated < 900


def long_stream(gw: Gateway, results: dict[str, Any], name: str, started: threading.Event) -> None:
    sdk = openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0, timeout=60)
    try:
        stream = sdk.chat.completions.create(
            model=MODEL,
            messages=CHAT["messages"],
            stream=True,
            max_tokens=300,
            extra_body={"ignore_eos": True},
        )
        count = 0
        for _ in stream:
            count += 1
            started.set()
        results[name] = count
    except openai.APIError as exc:
        results[name] = exc
    finally:
        started.set()


def test_spread_failover_recovery_and_in_band_error(
    worker: WorkerHandle, tiny_checkpoint: Any
) -> None:
    port = free_port()
    url_b = f"http://127.0.0.1:{port}"
    args = worker_args(tiny_checkpoint)
    # B starts first, so the gateway's startup check sees it healthy; active checks are then
    # 6 s apart, so right after B is killed the pool still routes to it (passive path).
    settings = {"health_interval_s": 6.0, "eject_after_failures": 1, "eject_cooldown_s": 0.5}
    with contextlib.ExitStack() as stack:
        b = stack.enter_context(worker_on_port(port, args))
        gw = stack.enter_context(running_gateway(workers=[worker.base_url, url_b], **settings))
        sdk = openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0, timeout=60)
        label_b = worker_id(url_b)
        assert gw.metric("dflash_worker_healthy", worker=label_b) == 1
        seen_a, seen_b = prompts_seen(worker), prompts_seen(b)
        for _ in range(4):
            sdk.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=2)
        assert prompts_seen(worker) > seen_a and prompts_seen(b) > seen_b  # load spreads
        b.process.kill()
        b.process.wait()
        for _ in range(4):  # requests routed to the dead worker are retried on the other
            reply = sdk.chat.completions.create(
                model=MODEL, messages=CHAT["messages"], max_tokens=2
            )
            assert reply.choices
        assert gw.metric("dflash_retries_total", model=MODEL) >= 1
        assert gw.metric("dflash_upstream_errors_total", worker=label_b) >= 1
        assert gw.metric("dflash_worker_healthy", worker=label_b) == 0  # ejected
        with worker_on_port(port, args) as b:
            wait_until(lambda: gw.metric("dflash_worker_healthy", worker=label_b) == 1)  # back
            results: dict[str, Any] = {}
            started = [threading.Event(), threading.Event()]
            threads = [
                threading.Thread(target=long_stream, args=(gw, results, str(i), started[i]))
                for i in range(2)
            ]
            for thread in threads:
                thread.start()
            for event in started:
                assert event.wait(30)
            assert running(b) == 1 and running(worker) == 1
            b.process.kill()
            for thread in threads:
                thread.join(60)
    errors = [r for r in results.values() if isinstance(r, openai.APIError)]
    counts = [r for r in results.values() if isinstance(r, int)]
    assert len(errors) == 1 and "Upstream failure" in errors[0].message
    assert len(counts) == 1 and counts[0] > 1


# First-byte, idle and total deadlines: test_proxy_faults (a fake worker that stays silent;
# deadlines fire within one watchdog tick, >= 5 ms, so sub-millisecond limits are no test).
