"""The embedded worker over real HTTP: the OpenAI SDK as client, a tiny random model."""

from __future__ import annotations

import json
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine.worker.app import create_app
from engine.worker.settings import WorkerSettings, load_settings
from tests.fixtures.tiny_models import TinyCheckpoint
from tests.fixtures.worker import AppHandle, metric, running_worker, scrape, serving_app

NAME = "tiny"
KEY = "test-key"
MAX_LEN = 256
AUTH = {"Authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint: TinyCheckpoint) -> TinyCheckpoint:
    return tiny_checkpoint  # the session's tiny random target + drafter (tests/conftest.py)


@pytest.fixture(scope="module")
def settings(ckpt: TinyCheckpoint) -> WorkerSettings:
    return load_settings(
        model=str(ckpt.target_dir),
        served_model_name=NAME,
        max_model_len=MAX_LEN,
        speculative_config={"method": "dflash", "model": str(ckpt.drafter_dir)},
        max_num_seqs=2,
        api_key=KEY,
        max_body_bytes=64 * 1024,
    )


@pytest.fixture(scope="module")
def worker(settings: WorkerSettings) -> Iterator[AppHandle]:
    with serving_app(settings) as handle:
        yield handle


@pytest.fixture
def client(worker: AppHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.base_url}/v1", api_key=KEY, max_retries=0)


def metrics_of(obj: Any) -> dict[str, Any]:
    extra = obj.model_extra or {}
    assert "metrics" in extra, obj
    metrics: dict[str, Any] = extra["metrics"]
    return metrics


def test_chat_non_streaming(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=NAME, messages=HI, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.model == NAME
    assert resp.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8
    m = metrics_of(resp)
    assert m["time_to_first_token_ms"] >= 0 and m["tokens_per_second"] > 0
    assert m["speculative_decoding"]["num_spec_tokens"] == 3


def test_chat_stream_equals_non_stream_and_ends_with_usage(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": NAME,
        "messages": HI,
        "max_tokens": 12,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 12
    # Usage as OpenAI defines it: on the last chunk only, unless continuous_usage_stats.
    assert [c for c in chunks if c.usage is not None] == [last]
    # The last chunk carries the request's speculation counts (whether its steps drafted is
    # the adaptive policy's choice, from the request's own acceptance).
    spec = metrics_of(last)["speculative_decoding"]
    assert spec["num_spec_steps"] + spec["num_plain_steps"] >= 1


@pytest.mark.anyio
async def test_async_completions_stream_and_not(worker: AppHandle) -> None:
    client = openai.AsyncOpenAI(base_url=f"{worker.base_url}/v1", api_key=KEY, max_retries=0)
    args: dict[str, Any] = {
        "model": NAME,
        "prompt": "import os\n",
        "max_tokens": 10,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    resp = await client.completions.create(**args)
    assert resp.object == "text_completion" and resp.choices[0].finish_reason == "length"
    stream = await client.completions.create(**args, stream=True)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == resp.choices[0].text
    # No stream_options: no usage anywhere (as OpenAI and vLLM without force-include).
    assert chunks[-1].choices and all(c.usage is None for c in chunks)
    await client.close()


def test_stop_strings_truncate_and_finish_with_stop(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {
        "model": NAME,
        "prompt": "class A:\n",
        "max_tokens": 24,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    full = client.completions.create(**args).choices[0].text
    assert len(full) >= 10, full
    stop = full[6:9]
    for value in (stop, [stop, "\x00never"]):
        got = client.completions.create(**args, stop=value).choices[0]
        assert got.text == full[: full.find(stop)]
        assert got.finish_reason == "stop"
    chunks = [c for c in client.completions.create(**args, stop=stop, stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == full[: full.find(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_top_k_one_is_greedy_and_seed_reproduces(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {"model": NAME, "messages": HI, "max_tokens": 10}
    body = {"ignore_eos": True}
    greedy = client.chat.completions.create(**args, temperature=0, extra_body=body)
    top1 = client.chat.completions.create(**args, temperature=1.0, extra_body={**body, "top_k": 1})
    assert top1.choices[0].message.content == greedy.choices[0].message.content
    a, b = (
        client.chat.completions.create(**args, temperature=1.0, top_p=0.9, seed=7, extra_body=body)
        for _ in range(2)
    )
    assert a.choices[0].message.content == b.choices[0].message.content


def test_max_completion_tokens(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=NAME,
        messages=HI,
        max_completion_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.usage is not None and resp.usage.completion_tokens == 5


def test_models_health_and_request_id(client: openai.OpenAI, worker: AppHandle) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(f"{worker.base_url}/health").status_code == 200
    r = httpx.post(
        f"{worker.base_url}/v1/completions",
        headers={**AUTH, "X-Request-Id": "r-1"},
        json={"prompt": "x", "max_tokens": 1},
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "r-1"


def test_sdk_errors_are_typed(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(
            model=NAME, messages=HI, response_format={"type": "json_object"}
        )
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.chat.completions.create(model=NAME, messages=HI, logit_bias={"99999": 3})
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=HI)
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=NAME, prompt="x")
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


CHAT, COMP = "/v1/chat/completions", "/v1/completions"
LONG_PROMPT = "word " * 2000


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        (CHAT, b"{not json", 400, None),
        (CHAT, b"[1, 2]", 400, None),
        (CHAT, {"messages": "hi"}, 400, "messages"),
        (CHAT, {"messages": HI, "temperature": "hot"}, 400, "temperature"),
        (CHAT, {"messages": HI, "max_tokens": "ten"}, 400, "max_tokens"),
        (CHAT, {"messages": HI, "model": "nope"}, 404, "model"),
        (CHAT, {"messages": []}, 400, "messages"),
        (CHAT, {}, 400, "messages"),
        (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role"),
        (
            CHAT,
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                    }
                ]
            },
            400,
            "messages[0].content[0]",
        ),
        (CHAT, {"messages": [{"content": "no role"}]}, 400, "messages[0].role"),
        (CHAT, {"messages": HI, "temperature": -0.5}, 400, "temperature"),
        (CHAT, {"messages": HI, "top_p": 0}, 400, "top_p"),
        (CHAT, {"messages": HI, "top_p": 1.5}, 400, "top_p"),
        (CHAT, {"messages": HI, "max_tokens": 0}, 400, "max_tokens"),
        (CHAT, {"messages": HI, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
        (CHAT, {"messages": HI, "max_tokens": MAX_LEN + 1}, 400, "max_tokens"),
        (CHAT, {"messages": HI, "n": 0}, 400, "n"),
        (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 21}, 400, "logprobs"),
        (CHAT, {"messages": HI, "top_logprobs": 2}, 400, "top_logprobs"),
        (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": -2}, 400, "top_logprobs"),
        (CHAT, {"messages": HI, "top_logprobs": -2}, 400, "top_logprobs"),  # vLLM's order
        (CHAT, {"messages": HI, "logprobs": 1}, 400, "logprobs"),
        (COMP, {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
        (COMP, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        (COMP, {"prompt": "x", "logprobs": 21, "echo": True}, 400, "logprobs"),
        (COMP, {"prompt": "x", "top_logprobs": 2}, 400, "top_logprobs"),
        (CHAT, {"messages": HI, "logit_bias": {"a": 1}}, 400, "logit_bias"),
        (CHAT, {"messages": HI, "logit_bias": {"99999": 1}}, 400, "logit_bias"),
        (CHAT, {"messages": HI, "logit_bias": {str(i): 1 for i in range(1025)}}, 400, "logit_bias"),
        (CHAT, {"messages": HI, "logit_bias": {"5": "up"}}, 400, "logit_bias.5"),
        (CHAT, {"messages": HI, "repetition_penalty": 0}, 400, "repetition_penalty"),
        (CHAT, {"messages": HI, "presence_penalty": 2.5}, 400, "presence_penalty"),
        (CHAT, {"messages": HI, "frequency_penalty": -3}, 400, "frequency_penalty"),
        (CHAT, {"messages": HI, "min_p": 1.5}, 400, "min_p"),
        (CHAT, {"messages": HI, "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens"),
        (CHAT, {"messages": HI, "min_tokens": -1}, 400, "min_tokens"),
        (CHAT, {"messages": HI, "bad_words": [" "]}, 400, "bad_words"),
        (CHAT, {"messages": HI, "bad_words": ["x"] * 129}, 400, "bad_words"),
        (CHAT, {"messages": HI, "allowed_token_ids": []}, 400, "allowed_token_ids"),
        (CHAT, {"messages": HI, "allowed_token_ids": [-1]}, 400, "allowed_token_ids"),
        (CHAT, {"messages": HI, "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
        (
            CHAT,
            {"messages": HI, "allowed_token_ids": [7], "stop_token_ids": [7], "min_tokens": 1},
            400,
            "allowed_token_ids",
        ),
        (CHAT, {"messages": HI, "stop": [""]}, 400, "stop"),
        (CHAT, {"messages": HI, "seed": 2**70}, 400, "seed"),
        (
            CHAT,
            b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
            400,
            None,  # refused while parsing the JSON, as the gateway does
        ),
        (CHAT, {"messages": HI, "stop_token_ids": ["a"]}, 400, "stop_token_ids[0]"),
        (COMP, {"prompt": LONG_PROMPT}, 400, "prompt"),
        (COMP, {"prompt": ""}, 400, "prompt"),
        (COMP, {"prompt": [10**9]}, 400, "prompt"),
        (COMP, {"prompt": ["a", 1]}, 400, "prompt"),
        (COMP, {"prompt": 5}, 400, "prompt"),
    ],
)
def test_bad_input_gets_an_openai_error(
    worker: AppHandle, path: str, body: Any, status: int, param: str | None
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        f"{worker.base_url}{path}",
        content=content,
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_context_errors_say_so(worker: AppHandle) -> None:
    r = httpx.post(
        f"{worker.base_url}{COMP}", headers=AUTH, timeout=30, json={"prompt": LONG_PROMPT}
    )
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 256" in r.json()["error"]["message"]


def test_oversized_bodies_get_413(worker: AppHandle) -> None:
    big = json.dumps({"prompt": "x" * 100_000}).encode()
    r = httpx.post(f"{worker.base_url}{COMP}", content=big, headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted while reading
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"y" * 8192
        yield b'"}'

    r = httpx.post(f"{worker.base_url}{COMP}", content=chunked(), headers=AUTH)
    assert r.status_code == 413


def test_unknown_routes_and_methods_are_openai_errors(worker: AppHandle) -> None:
    r = httpx.get(f"{worker.base_url}/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(f"{worker.base_url}{CHAT}")
    assert r.status_code == 405 and "error" in r.json()


def test_missing_api_key_is_401(worker: AppHandle) -> None:
    r = httpx.post(f"{worker.base_url}{COMP}", json={"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.anyio
async def test_health_is_503_until_the_engine_is_loaded(settings: WorkerSettings) -> None:
    app = create_app(settings)  # lifespan not run: the engine never loads
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://w") as http:
        r = await http.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        r = await http.post(CHAT, json={"messages": HI}, headers=AUTH)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        r = await http.get("/metrics")
        assert r.status_code == 200 and "vllm:num_requests_running" in r.text


# ---- a one-slot plain-decoding worker: full queue, disconnects, shutdown -----------------

# Long enough (seconds of decoding even on a fast box) to still be running when it matters.
LONG = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def busy(ckpt: TinyCheckpoint) -> Iterator[AppHandle]:
    settings = load_settings(
        model=str(ckpt.target_dir),
        served_model_name=NAME,
        max_model_len=4096,
        max_num_seqs=1,
        max_waiting=1,
    )
    with serving_app(settings) as handle:
        yield handle


def wait_for(check: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def running(base_url: str) -> float:
    return metric(scrape(base_url), "vllm:num_requests_running")


def first_data_line(lines: Iterator[str]) -> str:
    return next(line for line in lines if line.startswith("data: "))


def test_plain_worker_reports_no_speculation(busy: AppHandle) -> None:
    r = httpx.post(f"{busy.base_url}{COMP}", json={"prompt": "x", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200
    assert "speculative_decoding" not in r.json()["metrics"]
    assert metric(scrape(busy.base_url), "vllm:spec_decode_num_drafts_total") == 0


def waiting(base_url: str) -> float:
    return metric(scrape(base_url), "vllm:num_requests_waiting")


def test_full_worker_answers_503_and_a_queued_client_can_leave(busy: AppHandle) -> None:
    """One slot, one waiting place: a third request gets 503 + Retry-After; a waiting client
    that gives up is dropped from the queue while the first request keeps running."""
    url = f"{busy.base_url}{COMP}"
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", url, json={**LONG, "stream": True}) as r,
    ):
        lines = r.iter_lines()  # kept: dropping it would close the connection
        first_data_line(lines)
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(
                httpx.post,
                url,
                json={"prompt": "q", "max_tokens": 2},
                timeout=httpx.Timeout(30, read=2.0),
            )
            assert wait_for(lambda: waiting(busy.base_url) == 1)
            third = httpx.post(url, json={"prompt": "y", "max_tokens": 2}, timeout=30)
            assert third.status_code == 503
            assert third.headers["retry-after"] == "1"
            assert third.json()["error"]["code"] == "queue_full"
            with pytest.raises(httpx.ReadTimeout):
                queued.result()
        assert wait_for(lambda: waiting(busy.base_url) == 0)
        # A queued stream gets its 200 and headers at once (as vLLM), then leaves.
        with (
            httpx.Client(timeout=30) as other,
            other.stream("POST", url, json={"prompt": "s", "stream": True}) as s,
        ):
            assert s.status_code == 200 and waiting(busy.base_url) == 1
        assert wait_for(lambda: waiting(busy.base_url) == 0)
        assert running(busy.base_url) == 1  # the first request was not disturbed
    assert wait_for(lambda: running(busy.base_url) == 0)


def test_stream_disconnect_cancels_the_generation(busy: AppHandle) -> None:
    before = scrape(busy.base_url)
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{busy.base_url}{COMP}", json={**LONG, "stream": True}) as r,
    ):
        lines = r.iter_lines()  # kept: dropping it would close the connection
        first_data_line(lines)
        assert running(busy.base_url) == 1
    assert wait_for(lambda: running(busy.base_url) == 0)
    after = scrape(busy.base_url)
    aborted = metric(after, "vllm:request_success_total", finished_reason="abort") - metric(
        before, "vllm:request_success_total", finished_reason="abort"
    )
    generated = metric(after, "vllm:generation_tokens_total") - metric(
        before, "vllm:generation_tokens_total"
    )
    assert aborted == 1 and generated < LONG["max_tokens"]


def test_non_stream_disconnect_cancels_the_generation(busy: AppHandle) -> None:
    before = scrape(busy.base_url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{busy.base_url}{COMP}", json=LONG, timeout=httpx.Timeout(30, read=1.0))
    assert wait_for(lambda: running(busy.base_url) == 0)
    after = scrape(busy.base_url)
    generated = metric(after, "vllm:generation_tokens_total") - metric(
        before, "vllm:generation_tokens_total"
    )
    assert metric(after, "vllm:request_success_total", finished_reason="abort") > metric(
        before, "vllm:request_success_total", finished_reason="abort"
    )
    assert generated < LONG["max_tokens"]


def sse_payloads(lines: Iterator[str]) -> list[Any]:
    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_sigterm_drains_in_flight_then_aborts_past_the_timeout(ckpt: TinyCheckpoint) -> None:
    """After SIGTERM: no new work; a short stream finishes normally; a stream that outlives
    --drain-timeout ends with an in-band `aborted` error and [DONE]; the process exits."""
    short = {**LONG, "max_tokens": 40, "stream": True}
    long = {**LONG, "max_tokens": 4000, "stream": True}
    with (
        running_worker(
            str(ckpt.target_dir),
            "--max-model-len",
            "4096",
            "--max-num-seqs",
            "2",
            "--drain-timeout",
            "4",
        ) as w,
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{w.base_url}{COMP}", json=short) as a,
        http.stream("POST", f"{w.base_url}{COMP}", json=long) as b,
    ):
        a_lines, b_lines = a.iter_lines(), b.iter_lines()
        first_data_line(a_lines)
        first_data_line(b_lines)
        w.process.send_signal(signal.SIGTERM)
        assert wait_for(lambda: not _admits(w.base_url), timeout=20)
        finished = sse_payloads(a_lines)
        assert finished[-1] == "[DONE]"
        assert finished[-2]["choices"][0]["finish_reason"] == "length"
        cut = sse_payloads(b_lines)
        assert cut[-1] == "[DONE]"
        assert cut[-2]["error"]["code"] == "aborted"
        assert w.process.wait(timeout=60) in (0, -signal.SIGTERM)


def _admits(base_url: str) -> bool:
    """True while a new request would still be taken (refused connection or 503: not)."""
    try:
        return httpx.get(f"{base_url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.anyio
async def test_a_model_that_fails_to_load_is_fatal(ckpt: TinyCheckpoint, tmp_path: Path) -> None:
    broken = tmp_path / "target"
    shutil.copytree(ckpt.target_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    app = create_app(load_settings(model=str(broken)))
    state = app.state.worker
    fatal: list[bool] = []
    state.on_fatal = lambda: fatal.append(True)
    await state.load()
    assert fatal == [True] and state.load_error
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
        r = await c.get("/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "load_failed"


def test_vllm_defaults_and_ids(worker: AppHandle) -> None:
    """As vLLM: completions default to 16 tokens; the client's X-Request-Id becomes the body
    id; stop_reason says which stop string or stop token ended the answer."""
    headers = {**AUTH, "X-Request-Id": "trace-42"}
    body = {"prompt": "def f(x):", "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{worker.base_url}{COMP}", headers=headers, json=body, timeout=30).json()
    assert r["usage"]["completion_tokens"] == 16 and r["id"] == "cmpl-trace-42"
    assert r["choices"][0]["finish_reason"] == "length" and r["choices"][0]["stop_reason"] is None
    text = r["choices"][0]["text"]
    stop = text[3:5]
    r = httpx.post(
        f"{worker.base_url}{COMP}", headers=AUTH, json={**body, "stop": [stop]}, timeout=30
    ).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["stop_reason"] == stop
    cut = r["choices"][0]["text"]
    kept = {**body, "stop": [stop], "include_stop_str_in_output": True}
    r = httpx.post(f"{worker.base_url}{COMP}", headers=AUTH, json=kept, timeout=30).json()
    assert r["choices"][0]["text"] == cut + stop


def test_chat_stream_opens_with_a_role_chunk_then_the_first_token_alone(
    worker: AppHandle,
) -> None:
    body = {
        "messages": HI,
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with httpx.stream("POST", f"{worker.base_url}{CHAT}", headers=AUTH, json=body, timeout=30) as r:
        events = sse_payloads(r.iter_lines())
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    first = events[1]["choices"][0]
    assert first["finish_reason"] is None
    # The first token is sent on its own, straight after the prompt is processed.
    assert events[1]["usage"]["completion_tokens"] == 1
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 8
    assert events[-1] == "[DONE]"


def test_models_retrieve_version_tokenize_detokenize(
    client: openai.OpenAI, worker: AppHandle
) -> None:
    card = client.models.retrieve(NAME)
    assert card.id == NAME
    # What the gateway's /openapi.json bounds requests by: ids under the vocabulary, n.
    extra = card.model_extra or {}
    assert (
        extra["max_sequences_per_request"] == 2 + WorkerSettings.model_fields["max_waiting"].default
    )
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    version = httpx.get(f"{worker.base_url}/version", timeout=10).json()["version"]
    assert version and version != "unknown"
    base, post = worker.base_url, httpx.Client(headers=AUTH, timeout=30).post
    tok = post(
        f"{base}/tokenize", json={"prompt": "def add(a, b):", "return_token_strs": True}
    ).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) > 0
    assert tok["max_model_len"] == MAX_LEN
    back = post(f"{base}/detokenize", json={"tokens": tok["tokens"]}).json()
    assert back["prompt"] == "def add(a, b):"
    last, past = [extra["vocab_size"] - 1], [extra["vocab_size"]]
    assert post(f"{base}/detokenize", json={"tokens": last}).status_code == 200
    assert post(f"{base}/detokenize", json={"tokens": past}).json()["error"]["param"] == "tokens"
    assert (
        post(f"{base}/detokenize", json={"tokens": [float(t) for t in tok["tokens"]]}).json()[
            "prompt"
        ]
        == "def add(a, b):"
    )  # integers as floats with no fraction, as vLLM takes them
    chat_ids = post(f"{base}/tokenize", json={"messages": HI}).json()
    reply = client.chat.completions.create(model=NAME, messages=HI, max_tokens=1)  # type: ignore[arg-type]
    assert reply.usage is not None and chat_ids["count"] == reply.usage.prompt_tokens
    for path, body in [
        ("/tokenize", {}),
        ("/tokenize", {"prompt": "x", "messages": HI}),
        ("/detokenize", {"tokens": [10**9]}),
        ("/detokenize", {"tokens": "x"}),
        ("/tokenize", {"prompt": "x", "extra": 1}),
    ]:
        r = post(f"{base}{path}", json=body)
        assert r.status_code == 400 and r.json()["error"]["message"], (path, body, r.text)
    assert httpx.post(f"{base}/tokenize", json={"prompt": "x"}, timeout=10).status_code == 401


def _post(worker: AppHandle, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{worker.base_url}{path}", headers=AUTH, json=body, timeout=60)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_n_choices_and_batched_prompts(worker: AppHandle) -> None:
    greedy = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    alone = {
        p: _post(worker, COMP, {"prompt": p, **greedy})["choices"][0]["text"]
        for p in ("def a(", "class B:")
    }
    both = _post(worker, COMP, {"prompt": ["def a(", "class B:"], "n": 2, **greedy})
    assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in both["choices"]] == [alone["def a("]] * 2 + [alone["class B:"]] * 2
    assert both["usage"]["completion_tokens"] == 4 * 6
    single = _post(worker, COMP, {"prompt": "def a(", **greedy})["usage"]["prompt_tokens"]
    assert both["usage"]["prompt_tokens"] > single  # both prompts, each counted once
    assert "metrics" not in both  # per-request metrics describe one sequence (as vLLM)
    sampled = {"messages": HI, "n": 3, "max_tokens": 8, "temperature": 1.0, "seed": 7}
    first, again = _post(worker, CHAT, sampled), _post(worker, CHAT, sampled)
    texts = [c["message"]["content"] for c in first["choices"]]
    assert texts == [c["message"]["content"] for c in again["choices"]]  # seeded
    assert len(set(texts)) > 1  # the n samples differ


def test_echo_and_a_stream_of_several_choices(worker: AppHandle) -> None:
    body = {"prompt": "def a(", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = _post(worker, COMP, body)["choices"][0]["text"]
    echoed = _post(worker, COMP, {**body, "echo": True})["choices"][0]["text"]
    assert echoed == "def a(" + plain
    stream = {
        "messages": HI,
        "n": 2,
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", f"{worker.base_url}{CHAT}", headers=AUTH, json=stream, timeout=60
    ) as r:
        events = sse_payloads(r.iter_lines())
    texts = {0: "", 1: ""}
    roles = []
    for e in events[:-2]:
        choice = e["choices"][0]
        if "role" in choice["delta"]:
            roles.append(choice["index"])
        texts[choice["index"]] += choice["delta"].get("content", "")
    whole = _post(
        worker, CHAT, {k: v for k, v in stream.items() if k not in ("stream", "stream_options")}
    )
    assert sorted(roles) == [0, 1]
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in whole["choices"]]
    assert events[-2]["usage"]["completion_tokens"] == 10 and "metrics" not in events[-2]


def test_adaptive_speculation_shows_its_choices(ckpt: TinyCheckpoint) -> None:
    settings = load_settings(
        model=str(ckpt.target_dir),
        served_model_name=NAME,
        max_model_len=MAX_LEN,
        speculative_config={"method": "dflash", "model": str(ckpt.drafter_dir)},
        max_num_seqs=2,
        speculation="adaptive",
    )
    with serving_app(settings) as handle:
        body = {"prompt": "def f(x):", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{handle.base_url}{COMP}", json=body, timeout=60).json()
        spec = r["metrics"]["speculative_decoding"]
        assert spec["num_plain_steps"] >= 0 and spec["mean_draft_tokens_per_step"] >= 0
        samples = scrape(handle.base_url)
        steps = metric(samples, "dflash:spec_decode_steps_by_num_drafts_total")
        assert steps == spec["num_plain_steps"] + spec["num_spec_steps"] >= 1
        # Where the engine's time went, per kind of forward (one prefill at least).
        assert metric(samples, "dflash:engine_steps_total", kind="prefill") >= 1
        forwards = sum(
            metric(samples, "dflash:engine_steps_total", kind=kind)
            for kind in ("drafting", "plain")
        )
        assert forwards >= 1 and metric(samples, "dflash:engine_step_seconds_total") > 0


def _joined_bytes(content: Any) -> str:
    return b"".join(bytes(entry.bytes) for entry in content).decode("utf-8", errors="replace")


def test_chat_logprobs_through_the_sdk_stream_and_whole(client: openai.OpenAI) -> None:
    """One entry per output token, the tokens' own bytes spell the text, the top ones best
    first; a stream carries exactly the same entries as the whole response."""
    ask: dict[str, Any] = {
        "model": NAME,
        "messages": HI,
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**ask)
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == whole.usage.completion_tokens == 12  # type: ignore[union-attr]
    assert _joined_bytes(content) == whole.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest token
    streamed = []
    for chunk in client.chat.completions.create(**ask, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    # Same tokens; the values to float rounding: adaptive speculation may verify another
    # number of drafts on the second call, and a wider verify rounds attention differently.
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)


def test_completion_logprobs_zero_and_n(worker: AppHandle) -> None:
    def complete(logprobs: int) -> dict[str, Any]:
        body = {"prompt": "def f(x):", "max_tokens": 6, "temperature": 0, "logprobs": logprobs}
        r = httpx.post(f"{worker.base_url}/v1/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        lp: dict[str, Any] = r.json()["choices"][0]["logprobs"]
        return lp

    zero, two = complete(0), complete(2)
    assert zero["tokens"] == two["tokens"] and len(zero["tokens"]) == 6
    assert zero["token_logprobs"] == pytest.approx(two["token_logprobs"])
    # logprobs=0: the chosen token only; 2: the two likeliest (greedy: the chosen is one)
    assert [list(top) for top in zero["top_logprobs"]] == [[t] for t in zero["tokens"]]
    pairs = zip(two["top_logprobs"], two["tokens"], strict=True)
    assert all(len(top) == 2 and tok in top for top, tok in pairs)
    offsets = [sum(len(t) for t in zero["tokens"][:i]) for i in range(6)]
    assert zero["text_offset"] == offsets


def test_each_logits_processor_reaches_the_engine(worker: AppHandle) -> None:
    """Honoured processors, sent over HTTP, have their effect (every field's mapping:
    test_api.py; exactness under speculation: tests/engine/test_engine.py and
    test_speculative.py)."""

    def complete(**extra: Any) -> tuple[list[int], str]:
        body = {"prompt": "def f(x):", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(
            f"{worker.base_url}/v1/completions",
            json={**body, "logprobs": 0, **extra},
            headers=AUTH,
            timeout=60,
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["logprobs"]["tokens"], choice["finish_reason"]

    base, _ = complete()
    assert len(set(base)) > 1  # the tiny model does not repeat itself on its own
    # A repetition penalty below 1 favours what was seen (the prompt too): it repeats.
    repeated, _ = complete(repetition_penalty=0.05)
    assert len(set(repeated)) < len(set(base))
    forced, _ = complete(logit_bias={"100": 100})
    assert forced == complete(allowed_token_ids=[100])[0] and len(set(forced)) == 1
    assert complete(bad_words=[base[0]])[0][0] != base[0]
    first_id = httpx.post(
        f"{worker.base_url}/tokenize", json={"prompt": base[0]}, headers=AUTH, timeout=30
    ).json()["tokens"]
    stopped, reason = complete(stop_token_ids=first_id)
    assert len(stopped) == 1 and reason == "stop"
    held, _ = complete(stop_token_ids=first_id, min_tokens=4)
    assert len(held) >= 4


def test_echo_with_logprobs_scores_the_prompt(worker: AppHandle) -> None:
    """lm-eval-harness's loglikelihood request (echo, logprobs, max_tokens 0): the prompt's
    tokens with the target's logprobs (the first unscored), nothing generated shown; with
    max_tokens > 0 the completion's entries follow; a stream carries the same entries."""
    prompt = "def add(a, b):"
    body = {"prompt": prompt, "echo": True, "logprobs": 2, "temperature": 0}
    only = _post(worker, COMP, {**body, "max_tokens": 0})
    choice = only["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == prompt and "".join(lp["tokens"]) == prompt
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    assert only["usage"]["completion_tokens"] == 1  # generated and not shown, as vLLM
    more = _post(worker, COMP, {**body, "max_tokens": 4, "ignore_eos": True})["choices"][0]
    scored = more["logprobs"]
    n = len(lp["tokens"])
    assert scored["tokens"][:n] == lp["tokens"] and len(scored["tokens"]) == n + 4
    assert scored["token_logprobs"][:n] == lp["token_logprobs"]
    assert "".join(scored["tokens"]) == more["text"]
    r = httpx.post(
        f"{worker.base_url}{COMP}",
        json={**body, "max_tokens": 4, "ignore_eos": True, "stream": True},
        headers=AUTH,
        timeout=60,
    )
    streamed: list[str] = []
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            chunk_lp = json.loads(line[6:])["choices"][0]["logprobs"]
            streamed += chunk_lp["tokens"] if chunk_lp else []
    assert streamed == scored["tokens"]


@pytest.mark.parametrize(
    "options",
    [
        {"add_generation_prompt": False, "continue_final_message": True},
        {"add_generation_prompt": False},
        {"chat_template_kwargs": {"enable_thinking": False}},
    ],
)
def test_chat_template_options_are_the_prompt_they_render(
    worker: AppHandle, ckpt: TinyCheckpoint, options: dict[str, Any]
) -> None:
    """A chat request with template options answers exactly as a completion of the text
    the template renders with them (rendering itself: transformers' in test_tokenizer.py)."""
    from engine.tokenizer import Tokenizer

    messages = [*HI, {"role": "assistant", "content": "    return"}]
    greedy = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    chat = _post(worker, CHAT, {"messages": messages, **options, **greedy})
    render = {k: v for k, v in options.items() if k != "chat_template_kwargs"}
    kwargs = options.get("chat_template_kwargs")
    text = Tokenizer.from_dir(ckpt.target_dir).render_chat(
        messages, template_kwargs=kwargs, **render
    )
    completion = _post(worker, COMP, {"prompt": text, "add_special_tokens": False, **greedy})
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]
    assert chat["usage"]["prompt_tokens"] == completion["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"continue_final_message": True}, "continue_final_message"),  # with the gen. prompt
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"add_generation_prompt": "no"}, "add_generation_prompt"),
    ],
)
def test_chat_template_options_refused(
    worker: AppHandle, extra: dict[str, Any], param: str
) -> None:
    r = httpx.post(
        f"{worker.base_url}{CHAT}", json={"messages": HI, **extra}, headers=AUTH, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
