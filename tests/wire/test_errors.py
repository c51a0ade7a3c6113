"""Every malformed input gets a 4xx with an OpenAI error body, never a 5xx or a hang."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.service.conftest import MODEL, Gateway

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def assert_openai_error(reply: httpx.Response, status: int) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert reply.headers["x-request-id"]
    return dict(error)


@pytest.mark.parametrize(
    ("content", "status"),
    [
        (b"", 400),
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (b'"text"', 400),
        (
            b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
            b'"temperature": NaN}',
            400,
        ),
        (b"[" * 100_000 + b"]" * 100_000, 400),
        (b'{"messages": [{"role": "user", "content": "x"}]}', 400),
        (b'{"model": "tiny", "messages": "hello"}', 400),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": -1}', 400),
        (
            b'{"model": "tiny", "messages": [{"role": "user"}], "stream": true, '
            b'"stream_options": 3}',
            400,
        ),
        (b'{"model": "missing", "messages": [{"role": "user", "content": "x"}]}', 404),
        (b"\xff\xfe\x00", 400),
    ],
)
def test_malformed_chat_bodies(gateway: Gateway, content: bytes, status: int) -> None:
    reply = httpx.post(
        gateway.v1 + "/chat/completions",
        content=content,
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert_openai_error(reply, status)


def test_model_not_found_names_the_param(gateway: Gateway) -> None:
    reply = httpx.post(gateway.v1 + "/completions", json={"model": "gpt-9", "prompt": "x"})
    assert assert_openai_error(reply, 404) == {
        "message": "The model `gpt-9` does not exist. Served models: `tiny-coder`.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_worker_rejections_pass_through_as_4xx(gateway: Gateway) -> None:
    # Valid for the gateway, too long for the worker's context: the worker's own 400.
    reply = httpx.post(
        gateway.v1 + "/completions",
        timeout=30,
        json={"model": MODEL, "prompt": "x", "max_tokens": 100_000},
    )
    assert_openai_error(reply, 400)


def test_sdk_raises_typed_errors(gateway: Gateway) -> None:
    sdk = openai.OpenAI(base_url=gateway.v1, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        sdk.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_unknown_route_method_and_size(gateway: Gateway) -> None:
    assert_openai_error(httpx.get(gateway.v1 + "/embeddings"), 404)
    wrong = httpx.get(gateway.v1 + "/chat/completions")
    assert_openai_error(wrong, 405)
    assert wrong.headers["allow"] == "POST"
    # A path with two routes (GET and PUT): a 405 names both, not only the first route's.
    both = httpx.delete(gateway.base_url + "/admin/pools/some-pool")
    assert_openai_error(both, 405)
    assert both.headers["allow"] == "GET, PUT"
    huge = b'{"model": "tiny", "prompt": "' + b"x" * (5 * 1024 * 1024) + b'"}'
    assert_openai_error(httpx.post(gateway.v1 + "/completions", content=huge, timeout=30), 413)
