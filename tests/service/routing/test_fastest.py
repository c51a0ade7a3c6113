"""ROUTING=fastest: the speed map's choice, and through the real gateway, greedy and sampled
requests each sent to the pool that serves their class fastest."""

from __future__ import annotations

import math
from collections import Counter

import httpx
import pytest

from service.routing.fastest import MIN_SAMPLES, SpeedMap, load_level, pool_levels
from service.routing.fleet import Worker
from tests.service.conftest import running_gateway
from tests.service.fake_upstream import MODEL, Handler, fake_worker
from tests.service.routing.test_promotion_gateway import reporting


def trained(**speeds: float) -> SpeedMap:
    """pool=tokens/s for class "greedy/short" at level 0."""
    speed_map = SpeedMap(exploration=0.0)
    for pool, speed in speeds.items():
        for _ in range(MIN_SAMPLES):
            speed_map.observe(pool, "greedy/short", 0, speed)
    return speed_map


def test_the_pool_expected_fastest_at_its_level_is_chosen() -> None:
    speed_map = trained(dflash=200.0, plain=100.0)
    assert speed_map.choose("greedy/short", {"dflash": 0, "plain": 0}) == "dflash"
    for _ in range(MIN_SAMPLES):  # at level 3 the DFlash pool is slower
        speed_map.observe("dflash", "greedy/short", 3, 80.0)
        speed_map.observe("plain", "greedy/short", 3, 95.0)
    assert speed_map.choose("greedy/short", {"dflash": 3, "plain": 3}) == "plain"
    # A level without evidence borrows the nearest one's (lower first).
    assert speed_map.choose("greedy/short", {"dflash": 4, "plain": 4}) == "plain"
    assert speed_map.expected("dflash", "greedy/short", 1) == pytest.approx(math.log(200.0))


def test_no_estimate_or_exploring_routes_by_weights() -> None:
    speed_map = trained(dflash=200.0)
    assert speed_map.choose("greedy/short", {"dflash": 0, "plain": 0}) is None  # plain unknown
    assert speed_map.choose("sampled/short", {"dflash": 0}) is None  # class unknown
    exploring = trained(dflash=200.0, plain=100.0)
    exploring.exploration, exploring.draw = 0.05, lambda: 0.01
    assert exploring.choose("greedy/short", {"dflash": 0, "plain": 0}) is None


def test_load_levels_double() -> None:
    assert [load_level(x) for x in (1, 2, 3, 4, 5, 64, 65, 1000)] == [0, 1, 2, 2, 3, 6, 7, 7]
    a, b, c = (Worker(f"http://{n}:1", pool=p) for n, p in (("a", "x"), ("b", "x"), ("c", "y")))
    a.outstanding, b.outstanding, c.outstanding = 3, 1, 0
    assert pool_levels([a, b, c]) == {"x": load_level(2.5), "y": 0}


def class_worker(greedy: float, sampled: float) -> Handler:
    """A fake worker whose decode speed depends on the request's temperature."""
    return reporting(lambda request: greedy if request.get("temperature", 1.0) == 0 else sampled)


def test_each_class_goes_where_it_is_served_fastest() -> None:
    with (
        fake_worker(class_worker(300.0, 60.0)) as dflash,
        fake_worker(class_worker(120.0, 110.0)) as plain,
    ):
        pools = [
            {"name": "dflash", "model": MODEL, "workers": [dflash.url]},
            {"name": "plain", "model": MODEL, "workers": [plain.url]},
        ]
        with (
            running_gateway(pools=pools, routing="fastest") as gw,
            httpx.Client(timeout=10) as client,
        ):
            served: Counter[tuple[float, str]] = Counter()
            for n in range(400):
                temperature = 0.0 if n % 2 else 1.0
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"request {n}"}],
                    "temperature": temperature,
                }
                answer = client.post(gw.v1 + "/chat/completions", json=body)
                assert answer.status_code == 200
                if n >= 200:  # after learning
                    served[temperature, answer.headers["x-dflash-pool"]] += 1
            assert served[0.0, "dflash"] >= 0.85 * 100, served  # greedy: the DFlash pool
            assert served[1.0, "plain"] >= 0.85 * 100  # sampled: the plain pool
