"""The gateway app's own layer (no worker needed): request ids, the API-key gate in front of
every route, the OpenAPI schema with the request models, errors as OpenAI bodies."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from starlette.testclient import TestClient

from service.app import create_app, describe_pools, tear_down
from service.metrics import GatewayMetrics
from service.routing.fleet import WorkerFleet
from service.settings import GatewaySettings, PoolSpec
from service.tenancy.limits import RateLimiter
from service.tenancy.response_store import MemoryResponseStore


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


@pytest.mark.anyio
async def test_a_teardown_step_that_raises_does_not_skip_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[str] = []

    async def fails() -> None:
        ran.append("fails")
        raise RuntimeError("boom")

    async def flushes() -> None:
        ran.append("flushes")

    failed = await tear_down(
        ("stop first", fails),
        None,  # a step that does not apply
        ("flush next", flushes),
        ("close sync", lambda: ran.append("sync")),
    )
    assert ran == ["fails", "flushes", "sync"]
    assert failed == ["stop first"]
    assert "could not stop first" in caplog.text and "boom" in caplog.text


def test_the_gateway_closes_its_ledger_and_store_when_the_fleet_stop_fails(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The gateway's own shutdown: the fleet's stop raises, and the ledger (its backlog), the
    response store and the clients are still closed, and the failure is logged."""
    closed: list[str] = []

    async def broken_stop(self: WorkerFleet) -> None:
        raise RuntimeError("fleet stop failed")

    def spy(cls: type, name: str) -> None:
        original = getattr(cls, name)

        async def wrapper(self: object) -> None:
            closed.append(f"{cls.__name__}.{name}")
            await original(self)

        monkeypatch.setattr(cls, name, wrapper)

    monkeypatch.setattr(WorkerFleet, "stop", broken_stop)
    spy(RateLimiter, "close")
    spy(MemoryResponseStore, "close")
    settings = GatewaySettings(workers=["http://127.0.0.1:9"], api_keys=["sk-1"])
    with TestClient(create_app(settings), raise_server_exceptions=False):
        pass
    assert closed == ["RateLimiter.close", "MemoryResponseStore.close"]
    assert "could not stop the fleet's health checks" in caplog.text


def test_the_startup_log_names_each_pool_s_model_weight_and_workers() -> None:
    pools = [
        PoolSpec(name="base", model="m", weight=90, workers=["http://a:1", "http://a:2"]),
        PoolSpec(name="canary", model="m", weight=10, workers=["http://b:1"]),
    ]
    fleet = WorkerFleet(GatewaySettings(pools=pools), httpx.AsyncClient(), GatewayMetrics())
    assert describe_pools(fleet) == (
        "base (model m, weight 90, 2 worker(s)), canary (model m, weight 10, 1 worker(s))"
    )
