"""The gateway app's own layer (no worker needed): request ids, the API-key gate in front of
every route, the OpenAPI schema with the request models, errors as OpenAI bodies."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from service.app import create_app
from service.settings import GatewaySettings


@pytest.fixture
def client() -> Iterator[TestClient]:
    # Not entered as a context manager: the lifespan (pool, upstream clients) never starts,
    # so /v1 routes answer "starting" and everything in front of them is what is tested.
    settings = GatewaySettings(workers=["http://127.0.0.1:9"], api_keys=["sk-1"])
    yield TestClient(create_app(settings), raise_server_exceptions=False)


def test_missing_or_wrong_key_is_401_with_www_authenticate(client: TestClient) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "sk-1"}):
        r = client.post("/v1/chat/completions", json={}, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_request_id_is_kept_when_valid_and_replaced_when_not(client: TestClient) -> None:
    r = client.get("/health", headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = client.get("/health", headers={"X-Request-Id": "x" * 500})
    assert r.headers["x-request-id"] != "x" * 500 and len(r.headers["x-request-id"]) == 32


def test_before_start_the_proxy_answers_503_not_500(client: TestClient) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    r = client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-1"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    ready = client.get("/ready")
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "not_ready"


def test_openapi_lists_the_request_models(client: TestClient) -> None:
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert {"ChatCompletionRequest", "CompletionRequest"} <= set(schemas)
