"""Every response the gateway sends is counted in dflash_requests_total by status, the ones
it refused itself (400, 401, 404, 405, 413, 503) too, with their OpenAI error code in
dflash_gateway_errors_total; probes and scrapes are not client requests and stay out."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.service.conftest import Gateway, running_gateway, wait_until
from tests.service.fake_upstream import MODEL, fake_worker

KEY = "sk-count"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    with (
        fake_worker() as fake,
        running_gateway(workers=[fake.url], api_keys=[KEY], max_body_bytes=2048) as gateway,
    ):
        wait_until(lambda: gateway.state.live().fleet.routable() != [])
        yield gateway


def counted(gw: Gateway, **labels: str) -> float:
    return gw.metric("dflash_requests_total", **labels)


@pytest.mark.parametrize(
    ("method", "path", "body", "headers", "status", "code", "model"),
    [
        ("POST", CHAT, b"{not json", AUTH, 400, "invalid_json", "unknown"),
        ("POST", CHAT, b'{"model": "fake"}', AUTH, 400, "invalid_request_error", "unknown"),
        (
            "POST",
            CHAT,
            b'{"model": "fake", "messages": []}',
            None,
            401,
            "invalid_api_key",
            "unknown",
        ),
        (
            "POST",
            CHAT,
            b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}',
            AUTH,
            404,
            "model_not_found",
            "unknown",
        ),
        (
            "POST",
            CHAT,
            b'{"model": "fake", "prompt": "' + b"x" * 4096 + b'"}',
            AUTH,
            413,
            "request_too_large",
            "unknown",
        ),
        ("GET", CHAT, b"", AUTH, 405, "method_not_allowed", "unknown"),
        ("GET", "/v1/no-such-route", b"", AUTH, 404, "not_found", "unknown"),
        ("GET", "/v1/models/nope", b"", AUTH, 404, "model_not_found", "unknown"),
    ],
)
def test_a_refusal_is_counted_by_status_and_code(
    gw: Gateway,
    method: str,
    path: str,
    body: bytes,
    headers: dict[str, str] | None,
    status: int,
    code: str,
    model: str,
) -> None:
    endpoint = {CHAT: CHAT, "/v1/models/nope": "/v1/models/{model}"}.get(path, "other")
    labels = {"endpoint": endpoint, "status": str(status)}
    before = counted(gw, model=model, **labels)
    errors_before = gw.metric("dflash_gateway_errors_total", code=code, **labels)
    reply = httpx.request(method, gw.base_url + path, content=body, headers=headers, timeout=10)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["message"]
    assert counted(gw, model=model, **labels) == before + 1
    assert gw.metric("dflash_gateway_errors_total", code=code, **labels) == errors_before + 1


def test_relayed_and_successful_responses_are_counted_once_without_an_error_code(
    gw: Gateway,
) -> None:
    labels = {"model": MODEL, "endpoint": CHAT, "status": "200"}
    before = counted(gw, **labels)
    errors = gw.metric("dflash_gateway_errors_total")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    assert httpx.post(gw.base_url + CHAT, json=body, headers=AUTH).status_code == 200
    assert counted(gw, **labels) == before + 1
    assert gw.metric("dflash_gateway_errors_total") == errors


def test_probes_and_scrapes_are_not_counted(gw: Gateway) -> None:
    before = counted(gw)
    for path in ("/health", "/ready", "/metrics", "/openapi.json"):
        httpx.get(gw.base_url + path, headers=AUTH)
    assert counted(gw) == before
    httpx.get(gw.base_url + "/v1/models", headers=AUTH)
    assert counted(gw, endpoint="/v1/models", status="200") >= 1


def test_the_404_for_an_unknown_model_names_the_served_ones(gw: Gateway) -> None:
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}
    reply = httpx.post(gw.base_url + CHAT, json=body, headers=AUTH)
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["param"] == "model" and error["code"] == "model_not_found"
    assert error["message"] == f"The model `gpt-4o` does not exist. Served models: `{MODEL}`."


def test_a_routed_tokenize_is_counted_once(gw: Gateway) -> None:
    labels = {"model": MODEL, "endpoint": "/tokenize"}
    before = counted(gw, **labels)
    httpx.post(gw.base_url + "/tokenize", json={"model": MODEL, "prompt": "x"}, headers=AUTH)
    assert counted(gw, **labels) == before + 1
