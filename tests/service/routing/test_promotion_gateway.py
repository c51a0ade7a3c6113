"""Automatic promotion through the real gateway: two fake workers of one model, the canary
reporting a faster decode (vLLM's per-request `metrics.tokens_per_second`); the canary is
stepped up to all the traffic with no client error, dflash_pool_weight and the decisions say
so, /admin/pools shows the evidence, and an operator's pin wins."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from typing import Any

import httpx

from tests.service.conftest import running_gateway, wait_until
from tests.service.fake_upstream import MODEL, Handler, Request, fake_worker, reply


def reporting(speed: Callable[[dict[str, Any]], float]) -> Handler:
    """A fake worker answering every chat request with the decode speed `speed(request)`
    in vLLM's per-request `metrics.tokens_per_second` (promotion and fastest routing read it)."""

    async def handler(request: Request, writer: asyncio.StreamWriter) -> None:
        body = {
            "id": "c",
            "object": "chat.completion",
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "x"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13},
            "metrics": {"tokens_per_second": speed(json.loads(request.body))},
        }
        writer.write(reply("200 OK", json.dumps(body).encode()))

    return handler


def speed_worker(tokens_per_second: float, seed: int) -> Handler:
    """Decode speed around `tokens_per_second`, 10 % spread."""
    rng = random.Random(seed)
    return reporting(lambda _: tokens_per_second * rng.lognormvariate(0, 0.1))


def canary_pools(base: str, canary: str) -> list[dict[str, Any]]:
    """A baseline pool and a canary promoted against it (20 samples a stage)."""
    return [
        {"name": "base", "model": MODEL, "workers": [base]},
        {
            "name": "canary",
            "model": MODEL,
            "workers": [canary],
            "promotion": {"baseline": "base", "min_samples": 20},
        },
    ]


def test_a_faster_canary_is_promoted_to_all_the_traffic() -> None:
    with fake_worker(speed_worker(100.0, 1)) as base, fake_worker(speed_worker(130.0, 2)) as canary:
        pools = canary_pools(base.url, canary.url)
        with running_gateway(pools=pools) as gw:
            assert gw.metric("dflash_pool_weight", pool="canary") == 10.0
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "temperature": 0,
            }
            with httpx.Client(timeout=10) as client:
                statuses = [
                    client.post(gw.v1 + "/chat/completions", json=body).status_code
                    for _ in range(600)
                ]
                assert set(statuses) == {200}
                cards = {
                    c["pool"]: c for c in client.get(gw.base_url + "/admin/pools").json()["data"]
                }
                assert cards["canary"]["weight"] == 100.0 and cards["base"]["weight"] == 0.0
                rollout = cards["canary"]["promotion"]
                assert rollout["status"] == "promoted"
                assert [d["decision"] for d in rollout["decisions"]] == ["promote"] * 3
                assert 1.2 < rollout["decisions"][0]["speedup"] < 1.4
                assert gw.metric("dflash_pool_weight", pool="canary") == 100.0
                promoted = {"model": MODEL, "pool": "canary", "decision": "promote"}
                assert gw.metric("dflash_promotion_decisions_total", **promoted) == 3
                pinned = client.put(gw.base_url + "/admin/pools/base", json={"weight": 50})
                assert pinned.status_code == 200 and pinned.json()["pinned"] is True
                assert gw.metric("dflash_pool_weight", pool="base") == 50.0
                before = base.posts
                for _ in range(40):
                    client.post(gw.v1 + "/chat/completions", json=body)
                assert base.posts - before >= 10  # the pin routes traffic back to base
                bad = client.put(gw.base_url + "/admin/pools/base", json={"weight": 150})
                assert bad.status_code == 400 and "weight" in bad.json()["error"]["message"]
                missing = client.put(gw.base_url + "/admin/pools/nope", json={"weight": 5})
                assert missing.status_code == 404
                one = client.get(gw.base_url + "/admin/pools/base").json()
                assert one["pool"] == "base" and one["weight"] == 50.0 and one["pinned"]
                assert client.get(gw.base_url + "/admin/pools/nope").status_code == 404
                typo = client.put(gw.base_url + "/admin/pools/base", json={"wieght": 5})
                assert typo.status_code == 400 and typo.json()["error"]["param"] == "wieght"
                # Draining one pool is fine; draining the last weighted one is refused (the
                # split would offer every pool again), and changes nothing.
                drained = client.put(gw.base_url + "/admin/pools/canary", json={"weight": 0})
                assert drained.status_code == 200 and drained.json()["weight"] == 0
                last = client.put(gw.base_url + "/admin/pools/base", json={"weight": 0})
                assert last.status_code == 400 and last.json()["error"]["param"] == "weight"
                assert "every pool of model" in last.json()["error"]["message"]
                assert gw.metric("dflash_pool_weight", pool="base") == 50.0


def test_pinning_needs_an_admin_key(tmp_path) -> None:  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        "tenants:\n  - {name: app, keys: [sk-app]}\n  - {name: ops, keys: [sk-ops], admin: true}\n"
    )
    with fake_worker(speed_worker(100.0, 1)) as base:
        pools = [{"name": "base", "model": MODEL, "workers": [base.url]}]
        with running_gateway(pools=pools, api_key_file=keys) as gw:
            put = gw.base_url + "/admin/pools/base"
            assert httpx.put(put, json={"weight": 5}).status_code == 401
            denied = httpx.put(put, json={"weight": 5}, headers={"Authorization": "Bearer sk-app"})
            assert denied.status_code == 403
            assert denied.json()["error"]["code"] == "permission_denied"
            ops = {"Authorization": "Bearer sk-ops"}
            assert httpx.put(put, json={"weight": 5}, headers=ops).json()["weight"] == 5
            assert httpx.put(put, json={"weight": None}, headers=ops).json()["weight"] == 100
            # As docs/gateway.md's curl sends it (`-d`: a form's Content-Type): read as JSON,
            # as /v1 bodies are, and the key checked first.
            form = {"Content-Type": "application/x-www-form-urlencoded"}
            app = {"Authorization": "Bearer sk-app", **form}
            assert httpx.put(put, content=b'{"weight": 5}', headers=app).status_code == 403
            curl = httpx.put(put, content=b'{"weight": 7}', headers={**ops, **form})
            assert curl.status_code == 200 and curl.json()["weight"] == 7
            garbled = httpx.put(put, content=b"nope", headers={**ops, **form})
            assert garbled.status_code == 400
            assert garbled.json()["error"]["code"] == "invalid_json"
            listed = httpx.get(
                gw.base_url + "/admin/pools", headers={"Authorization": "Bearer sk-app"}
            )
            assert listed.status_code == 200 and listed.json()["data"][0]["pool"] == "base"


def test_a_pool_named_for_no_model_shows_what_its_workers_serve() -> None:
    """dflash-serve's own pool names no model: its card shows the one its worker lists."""
    with fake_worker(speed_worker(100.0, 1)) as base, running_gateway(workers=[base.url]) as gw:
        wait_until(lambda: httpx.get(gw.base_url + "/ready").status_code == 200)
        wait_until(lambda: httpx.get(gw.base_url + "/admin/pools").json()["data"][0]["models"])
        (card,) = httpx.get(gw.base_url + "/admin/pools").json()["data"]
        assert card["model"] == MODEL and card["models"] == [MODEL]
