"""Promotion shared through a real Redis (Debian's redis-server, tests/fixtures/redis.py): two
gateway replicas, each receiving half the traffic, report the same weights at every sample
(taken with the traffic paused for a few sync intervals), each decision is taken once, and a
pin set on one replica routes the other."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from service.routing.promotion import Promotions
from service.routing.promotion_store import SharedPromotions
from service.tenancy.redis_client import RedisUnavailable
from tests.fixtures.redis import RedisServer, running_redis
from tests.service.conftest import running_gateway, wait_until
from tests.service.fake_upstream import MODEL, fake_worker
from tests.service.routing.test_promotion_gateway import canary_pools, speed_worker

SYNC_S = 0.1


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


def weights(client: httpx.Client, base_url: str) -> dict[str, Any]:
    cards = client.get(base_url + "/admin/pools").json()["data"]
    return {card["pool"]: card["weight"] for card in cards}


def test_two_replicas_route_by_the_same_weights(redis_server: RedisServer) -> None:
    with fake_worker(speed_worker(100.0, 1)) as base, fake_worker(speed_worker(130.0, 2)) as canary:
        pools = canary_pools(base.url, canary.url)
        shared = {"pools": pools, "redis_url": redis_server.url, "promotion_sync_s": SYNC_S}
        with running_gateway(**shared) as one, running_gateway(**shared) as two:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            samples = []
            with httpx.Client(timeout=10) as client:
                for _ in range(30):
                    for gw in (one, two):
                        for _ in range(25):
                            reply = client.post(gw.v1 + "/chat/completions", json=body)
                            assert reply.status_code == 200
                    time.sleep(4 * SYNC_S)  # traffic paused: every replica has synced
                    seen = (weights(client, one.base_url), weights(client, two.base_url))
                    samples.append(seen)
                    assert seen[0] == seen[1], samples
                    if seen[0]["canary"] == 100.0:
                        break
                assert samples[-1][0] == {"base": 0.0, "canary": 100.0}
                assert len({tuple(s[0].items()) for s in samples}) >= 2  # it moved
                decisions = sum(
                    gw.metric("dflash_promotion_decisions_total", decision="promote")
                    for gw in (one, two)
                )
                assert decisions == 3  # each decision taken by one replica only
                cards = client.get(two.base_url + "/admin/pools").json()["data"]
                rollout = next(c for c in cards if c["pool"] == "canary")["promotion"]
                assert [d["decision"] for d in rollout["decisions"]] == ["promote"] * 3
                client.put(one.base_url + "/admin/pools/base", json={"weight": 40})
                wait_until(lambda: weights(client, two.base_url)["base"] == 40.0, timeout=5)
                client.put(one.base_url + "/admin/pools/base", json={"weight": None})
                wait_until(lambda: weights(client, two.base_url)["base"] == 0.0, timeout=5)


class FlakyRedis:
    """Down for the first `down` calls, then an empty pins hash."""

    def __init__(self, down: int) -> None:
        self.down, self.calls = down, 0
        self.seen_40 = asyncio.Event()

    async def call(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls >= 40:
            self.seen_40.set()
        if self.calls <= self.down:
            raise RedisUnavailable("connection refused")
        return []

    async def close(self) -> None:
        return None


def test_a_store_that_is_down_is_logged_once_per_interval_not_per_sync(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Synced every 10 ms, down for 30 syncs: one warning (it was one every sync, twice a
    second at the default interval), then one when it works again."""
    promotions = Promotions([], {}, lambda weights: None, lambda pool: True, lambda r, d: None)
    client = FlakyRedis(down=30)
    shared = SharedPromotions(promotions, client, 0.01)  # type: ignore[arg-type]

    async def run() -> None:
        shared.start()
        await client.seen_40.wait()
        await shared.close()

    with caplog.at_level(logging.WARNING, logger="dflash.gateway.promotion"):
        asyncio.run(run())
    failing = [m for m in caplog.messages if "Redis sync failing" in m]
    assert len(failing) == 1 and "connection refused" in failing[0]
    assert caplog.messages.count("promotion: Redis sync works again") == 1
