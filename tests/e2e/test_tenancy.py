"""Tenants' limits end to end: real gateway processes sharing a real redis-server, a fake
worker that reports usage like vLLM (non-streamed and in a stream's usage chunk), the OpenAI
SDK's own retries, and Redis killed under load."""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.fixtures.redis import RedisServer, ServerTls, running_redis
from tests.fixtures.tls_certs import make_certs
from tests.service.conftest import scrape, wait_until
from tests.service.fake_upstream import (
    MODEL,
    SSE_HEAD,
    FakeWorker,
    Request,
    chunked,
    fake_worker,
    reply,
)
from tests.service.gateway_process import gateway_process

USAGE = b'"usage":{"prompt_tokens":4,"completion_tokens":6,"total_tokens":10}'
TENANTS = """
tenants:
  - name: search
    keys: [sk-search]
    requests_per_minute: {rpm}
    tokens_per_minute: {tpm}
    concurrent_requests: {cap}
  - name: ops
    keys: [sk-ops]
    admin: true
"""


async def metered(request: Request, writer: asyncio.StreamWriter) -> None:
    """A worker that reports 10 tokens per request, streamed or not; slow when asked."""
    if b"slow" in request.body:
        await asyncio.sleep(1.0)
    if b'"stream":true' in request.body.replace(b" ", b""):
        content = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
        usage = b'data: {"id":"c","choices":[],' + USAGE + b"}\n\n"
        body = chunked(content) + chunked(usage) + chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        writer.write(SSE_HEAD + body)
    else:
        body = b'{"id":"c","object":"chat.completion","choices":[{"index":0,"message":'
        body += b'{"role":"assistant","content":"hi"},"finish_reason":"stop"}],' + USAGE + b"}"
        writer.write(reply("200 OK", body))


@pytest.fixture
def worker() -> Iterator[FakeWorker]:
    with fake_worker(metered) as fake:
        yield fake


@pytest.fixture
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


def key_file(tmp_path: Path, rpm: int = 1000, tpm: int = 100000, cap: int = 100) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text(TENANTS.format(rpm=rpm, tpm=tpm, cap=cap))
    return path


def chat(base: str, key: str = "sk-search", **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(base + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def fresh_window(window_s: float, need_s: float) -> None:
    left = window_s - time.time() % window_s
    if left < need_s:
        time.sleep(left + 0.01)


def in_parallel(calls: list[Callable[[], httpx.Response]]) -> list[httpx.Response]:
    barrier = threading.Barrier(len(calls))

    def run(call: Callable[[], httpx.Response]) -> httpx.Response:
        barrier.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


@contextlib.contextmanager
def two_gateways(worker: FakeWorker, env: dict[str, str]) -> Iterator[tuple[str, str]]:
    """Two gateway processes with the same settings (two replicas): their base URLs."""
    with gateway_process(worker.url, **env) as (a, _), gateway_process(worker.url, **env) as (b, _):
        yield a, b


def hour_windows(tmp_path: Path, redis: RedisServer, **limits: int) -> dict[str, str]:
    """Settings of gateways sharing `redis` whose windows last an hour (an exactness test must
    not see one end, nor a deadline missed on a loaded machine: that is served open), started
    at least 30 s before the current window ends."""
    fresh_window(3600, 30)
    window = {"rate_limit_window_s": "3600", "redis_url": redis.url, "rate_limit_deadline_s": "2"}
    return {"api_key_file": str(key_file(tmp_path, **limits)), **window}


def test_two_gateways_sharing_redis_admit_exactly_the_request_limit(
    worker: FakeWorker, redis: RedisServer, tmp_path: Path
) -> None:
    with two_gateways(worker, hour_windows(tmp_path, redis, rpm=7)) as (a, b):
        answers = in_parallel([lambda base=base: chat(base) for base in (a, b) * 10])
        statuses = sorted(r.status_code for r in answers)
        assert statuses == [200] * 7 + [429] * 13
        remaining = sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in answers)
        assert remaining[13:] == [0, 1, 2, 3, 4, 5, 6]  # each admission counted once, atomically
        refused = next(r for r in answers if r.status_code == 429)
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
        assert "Limit 7, Used 7" in error["message"]
        assert 0 < int(refused.headers["retry-after"]) <= 3600
        assert refused.headers["x-ratelimit-limit-requests"] == "7"
        assert re.fullmatch(r"(\d+m)?[\d.]+s", refused.headers["x-ratelimit-reset-requests"])
        # Other tenants are not limited by this one; the admin sees both in the ledger.
        assert chat(a, "sk-ops").status_code == 200
        usage = httpx.get(b + "/admin/usage", headers={"Authorization": "Bearer sk-ops"}).json()
        cards = {card["tenant"]: card for card in usage["data"]}
        assert (
            cards["search"]["window"]["requests"] == 7 and cards["ops"]["window"]["requests"] == 1
        )
        assert cards["search"]["limits"]["requests_per_minute"] == 7
        per_gateway = [
            scrape(base, "dflash_tenant_requests_total", tenant="search", status="429")
            for base in (a, b)
        ]
        assert sum(per_gateway) == 13
        limited = [
            scrape(base, "dflash_tenant_rate_limited_total", limit="requests") for base in (a, b)
        ]
        assert sum(limited) == 13


def test_two_gateways_on_one_tls_redis_as_an_acl_user_admit_exactly_the_limit(
    worker: FakeWorker, tmp_path: Path
) -> None:
    """Managed Redis's way: rediss:// checked against a CA, an ACL user whose password comes
    apart from the URL, and a client certificate (mutual TLS)."""
    certs = make_certs(tmp_path)
    tls = ServerTls(certs.path("server.crt"), certs.path("server.key"), certs.ca, "yes")
    acl = ["--user", "ledger", "on", ">ledger-pw", "~{dflash:*", "+@all"]
    with running_redis(tmp_path, tls=tls, args=acl) as redis:
        env = hour_windows(tmp_path, redis, rpm=5)
        env["redis_url"] = f"rediss://ledger@127.0.0.1:{redis.port}/0"
        env |= {"redis_password": "ledger-pw", "redis_tls_ca_file": str(certs.ca)}
        env["redis_tls_cert_file"] = str(certs.path("client.crt"))
        env["redis_tls_key_file"] = str(certs.path("client.key"))
        with two_gateways(worker, env) as (a, b):
            answers = in_parallel([lambda base=base: chat(base) for base in (a, b) * 6])
            assert sorted(r.status_code for r in answers) == [200] * 5 + [429] * 7
            assert scrape(a, "dflash_rate_limit_store_errors_total") == 0
        month = time.strftime("%Y-%m", time.gmtime())
        assert redis.command("GET", f"{{dflash:search}}:mr:{month}") == "5"
        assert redis.command("GET", f"{{dflash:search}}:mt:{month}") == "50"


def test_tokens_are_charged_at_the_end_streams_included(
    worker: FakeWorker, redis: RedisServer, tmp_path: Path
) -> None:
    with two_gateways(worker, hour_windows(tmp_path, redis, tpm=35)) as (a, b):
        seen = []
        for index, base in enumerate((a, b, a, b, a)):
            stream = index % 2 == 1
            answer = chat(base, stream=stream)
            seen.append((answer.status_code, answer.headers.get("x-ratelimit-remaining-tokens")))
            if stream and answer.status_code == 200:
                assert '"usage"' not in answer.text  # charged, yet not shown: not asked for
        # 10 tokens each, charged before the answer ends: each next request sees them.
        assert seen == [(200, "35"), (200, "25"), (200, "15"), (200, "5"), (429, "0")]
        headers = {"Authorization": "Bearer sk-search"}
        card = httpx.get(a + "/admin/usage", headers=headers).json()["data"]
        assert [c["tenant"] for c in card] == ["search"]  # a tenant's key sees its own only
        assert card[0]["window"]["tokens"] == 40 and card[0]["month"]["tokens"] >= 40
        other = httpx.get(a + "/admin/usage", params={"tenant": "ops"}, headers=headers)
        assert other.status_code == 404 and other.json()["error"]["param"] == "tenant"
        prompt = [scrape(x, "dflash_tenant_prompt_tokens_total", tenant="search") for x in (a, b)]
        completion = [
            scrape(x, "dflash_tenant_completion_tokens_total", tenant="search") for x in (a, b)
        ]
        assert (sum(prompt), sum(completion)) == (16, 24)


def test_the_concurrency_cap_holds_across_gateways(
    worker: FakeWorker, redis: RedisServer, tmp_path: Path
) -> None:
    env = {"api_key_file": str(key_file(tmp_path, cap=2)), "redis_url": redis.url}
    with two_gateways(worker, env) as (a, b):
        slow = [{"role": "user", "content": "slow"}]
        answers = in_parallel([lambda base=base: chat(base, messages=slow) for base in (a, b) * 3])
        assert sorted(r.status_code for r in answers) == [200, 200, 429, 429, 429, 429]
        busy = next(r for r in answers if r.status_code == 429)
        assert "concurrent requests: Limit 2" in busy.json()["error"]["message"]
        assert busy.headers["retry-after"] == "1"
        assert chat(a).status_code == 200  # the leases came back
        assert redis.command("ZCARD", "{dflash:search}:c") == "0"


def test_the_openai_sdk_retries_through_a_reset_window(worker: FakeWorker, tmp_path: Path) -> None:
    """No Redis: one gateway process counts alone (what `make serve` does)."""
    env = {"api_key_file": str(key_file(tmp_path, rpm=1)), "rate_limit_window_s": "2"}
    with gateway_process(worker.url, **env) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="sk-search", max_retries=3)
        fresh_window(2, 1.5)
        first = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )
        assert first.headers["x-ratelimit-limit-requests"] == "1"
        assert first.headers["x-ratelimit-remaining-requests"] == "0"
        reset = first.headers["x-ratelimit-reset-requests"]
        assert re.fullmatch(r"\d+(\.\d+)?m?s", reset), reset
        started = time.monotonic()
        second = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )
        assert second.choices[0].message.content == "hi"
        assert time.monotonic() - started < 4  # waited for the window, not a backoff of its own
        assert scrape(base, "dflash_tenant_rate_limited_total", tenant="search") >= 1
        no_retries = openai.OpenAI(base_url=base + "/v1", api_key="sk-search", max_retries=0)
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.RateLimitError) as caught:
            no_retries.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}]
            )
        assert caught.value.code == "rate_limit_exceeded"


def test_redis_killed_under_load_open_serves_closed_refuses_nothing_hangs(
    worker: FakeWorker, redis: RedisServer, tmp_path: Path
) -> None:
    env = {"api_key_file": str(key_file(tmp_path)), "redis_url": redis.url}
    closed_env = {**env, "rate_limit_failure_mode": "closed"}
    with (
        gateway_process(worker.url, **env) as (open_, _),
        gateway_process(worker.url, **closed_env) as (closed, _),
    ):
        results: dict[str, list[tuple[float, int, float]]] = {open_: [], closed: []}
        stop = time.monotonic() + 3.0
        killed_at = [0.0]

        def load(base: str) -> None:
            while time.monotonic() < stop:
                started = time.monotonic()
                status = chat(base).status_code
                results[base].append((started, status, time.monotonic() - started))

        threads = [threading.Thread(target=load, args=(base,)) for base in (open_, closed) * 2]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        killed_at[0] = time.monotonic()
        redis.kill()
        for thread in threads:
            thread.join(30)
        for base in (open_, closed):
            assert max(took for _, _, took in results[base]) < 1.0  # deadline 0.1 s: no hang
            before = {status for at, status, took in results[base] if at + took < killed_at[0]}
            assert before == {200}  # answered before the kill
        assert {status for at, status, _ in results[open_] if at > killed_at[0]} == {200}
        after_closed = [s for at, s, _ in results[closed] if at > killed_at[0] + 0.2]
        assert after_closed and set(after_closed) == {503}
        refused = chat(closed)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "rate_limit_store_unavailable"
        assert scrape(open_, "dflash_rate_limit_store_errors_total", outcome="served") > 0
        redis.start()  # limits come back once it answers again
        wait_until(lambda: chat(closed).status_code == 200, timeout=10)
        assert chat(open_).status_code == 200


def test_a_redis_stall_under_load_loses_no_lease_and_no_request(
    worker: FakeWorker, redis: RedisServer, tmp_path: Path
) -> None:
    """Redis paused (SIGSTOP) for 5 s while two gateways serve a capped tenant: admissions and
    settlements miss their deadline and are served open; once it resumes, every lease comes
    back and the month counts each request served, and its tokens, once."""
    limits = key_file(tmp_path, rpm=10**6, tpm=10**8, cap=4)
    env = {"api_key_file": str(limits), "redis_url": redis.url}
    with two_gateways(worker, env) as (a, b):
        served: list[int] = []
        stop = time.monotonic() + 8.0

        def load(base: str, stream: bool) -> None:
            while time.monotonic() < stop:
                if chat(base, stream=stream).status_code == 200:
                    served.append(1)

        threads = [
            threading.Thread(target=load, args=(base, index % 2 == 0))
            for index, base in enumerate((a, b) * 4)
        ]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        redis.pause()
        try:
            time.sleep(5.0)
        finally:
            redis.resume()
        for thread in threads:
            thread.join(30)
        month = time.strftime("%Y-%m", time.gmtime())
        counted = f"{{dflash:search}}:mr:{month}"
        wait_until(lambda: redis.command("GET", counted) == str(len(served)), timeout=10)
        assert redis.command("ZCARD", "{dflash:search}:c") == "0"  # no lease held
        assert redis.command("GET", f"{{dflash:search}}:mt:{month}") == str(10 * len(served))
        for base in (a, b):
            assert scrape(base, "dflash_rate_limit_ledger_backlog") == 0
            assert scrape(base, "dflash_rate_limit_ledger_lost_total") == 0
        assert sum(scrape(x, "dflash_rate_limit_settle_retries_total") for x in (a, b)) > 0
        assert sum(scrape(x, "dflash_rate_limit_store_errors_total") for x in (a, b)) > 0
        assert all(chat(base).status_code == 200 for base in (a, b) * 3)  # not locked out


def test_a_bad_tenant_file_or_unshared_limits_stop_startup(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants:\n  - {name: search, keys: [sk-1], tokens_per_minut: 5}\n")
    argv = [sys.executable, "-m", "service.cli", "--worker", "http://127.0.0.1:9"]
    done = subprocess.run(
        [*argv, "--api-key-file", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "tenants.'search'.tokens_per_minut: Extra inputs are not permitted" in done.stderr
    good = key_file(tmp_path)
    done = subprocess.run(
        [*argv, "--api-key-file", str(good), "--processes", "2", "--port", "18999"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "DFLASH_GATEWAY_REDIS_URL" in done.stderr
