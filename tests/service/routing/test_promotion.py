"""Automatic promotion, at unit level: seeded replays of request traces through the decision
logic (no servers). The traces are drawn from a model of per-request decode speed: four request
classes (greedy or sampled, short or long prompts) with their own speeds, and a log-normal
spread of 25 % per request, about what the embedded worker's per-request speeds show under a
mixed load; a canary's speed is its baseline's times a factor."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import pytest
from pydantic import ValidationError

from service.routing.promotion import (
    Promotions,
    PromotionSpec,
    Rollout,
    Tally,
    decide,
    request_class,
)
from service.routing.sequential import Moments
from service.settings import GatewaySettings

CLASSES = {  # class: (share of requests, baseline tokens/s)
    "greedy/short": (0.4, 120.0),
    "sampled/short": (0.4, 60.0),
    "greedy/long": (0.1, 80.0),
    "sampled/long": (0.1, 45.0),
}
SPREAD = 0.25
BASE = {"canary": 100.0, "base": 100.0}  # the pools' configured weights


@dataclass
class Replay:
    rollout: Rollout
    promotions: Promotions
    weights: dict[str, float]
    decisions: list[str]


def replay(factor: float, seed: int, requests: int, **spec: Any) -> tuple[Replay, list[float]]:
    """`requests` requests split by the rollout's current weights; the canary share after
    each one."""
    rng = random.Random(seed)
    weights: dict[str, float] = {}
    decisions: list[str] = []
    rollout = Rollout("m", "canary", "base", PromotionSpec(baseline="base", **spec))
    promotions = Promotions(
        [rollout], BASE, weights.update, lambda pool: True, lambda _, d: decisions.append(d)
    )
    shares = []
    classes, shares_of = list(CLASSES), [share for share, _ in CLASSES.values()]
    for _ in range(requests):
        pool = "canary" if rng.random() * 100 < weights["canary"] else "base"
        klass = rng.choices(classes, shares_of)[0]
        speed = CLASSES[klass][1] * (factor if pool == "canary" else 1.0)
        promotions.observe(pool, klass, speed * rng.lognormvariate(0, SPREAD), None)
        shares.append(weights["canary"])
    return Replay(rollout, promotions, weights, decisions), shares


def test_a_better_canary_reaches_all_the_traffic_within_2000_requests() -> None:
    for seed in range(10):
        result, shares = replay(1.15, seed, 2000)
        assert result.rollout.status == "promoted", seed
        assert shares.index(100.0) < 2000 and result.weights == {"canary": 100.0, "base": 0.0}
        assert result.decisions == ["promote"] * 3


def test_a_worse_canary_is_rolled_back_within_1000_requests() -> None:
    for seed in range(10):
        result, shares = replay(0.85, seed, 1000)
        assert result.rollout.status == "rolled_back", seed
        assert shares[-1] == 0.0
        assert result.weights == {"canary": 0.0, "base": 100.0}
        assert result.decisions == ["rollback"]


def test_an_identical_canary_is_rarely_promoted_past_its_first_stage() -> None:
    """The goal: at most 5 % of 20 seeded replays; measured over 200 for the rate itself."""
    promoted = [replay(1.0, seed, 3000)[1][-1] > 10.0 for seed in range(200)]
    assert sum(promoted[:20]) <= 1
    assert sum(promoted) / len(promoted) <= 0.05


def test_peeking_after_every_request_does_not_inflate_false_promotions() -> None:
    """The same identical canary, decided once at the end (a fixed-sample test) or after every
    request: the always-valid test's error stays within alpha either way."""
    alpha = 0.05
    ever = sum(replay(1.0, seed, 1500, alpha=alpha)[0].decisions != [] for seed in range(100))
    assert ever / 100 <= 2 * alpha  # two-sided: promote or rollback


def trace_rollout(**spec: Any) -> Rollout:
    return Rollout("m", "canary", "base", PromotionSpec(baseline="base", min_samples=5, **spec))


def test_a_failing_or_unhealthy_canary_is_never_promoted() -> None:
    rollout = trace_rollout()
    rng = random.Random(3)
    for pool, speed in (("base", 100.0), ("canary", 150.0)):
        for _ in range(40):
            speeds = rollout.speeds.setdefault(pool, {}).setdefault("greedy/short", Moments())
            speeds.add(math.log(speed * rng.uniform(0.95, 1.05)))
    assert decide(rollout, healthy=True)[0] == "promote"
    assert decide(rollout, healthy=False)[0] == "hold"
    rollout.requests.update(canary=40, base=40)
    rollout.errors["canary"] = 1  # 2.4 %: above max_error_rate with enough requests
    assert decide(rollout, healthy=True)[0] == "rollback"
    rollout.spec = PromotionSpec(baseline="base", min_samples=5, max_error_rate=0.5)
    assert decide(rollout, healthy=True)[0] == "hold"  # fails more than its baseline


def test_a_pin_wins_over_the_decisions() -> None:
    weights: dict[str, float] = {}
    rollout = trace_rollout()
    promotions = Promotions([rollout], BASE, weights.update, lambda p: True, lambda r, d: None)
    promotions.pin("canary", 3.0)
    assert weights == {"canary": 3.0, "base": 90.0}
    rng = random.Random(2)
    for _ in range(400):
        for pool, speed in (("base", 100.0), ("canary", 200.0)):
            promotions.observe(pool, "greedy/short", speed * rng.lognormvariate(0, 0.05), None)
    assert rollout.status == "promoted" and weights == {"canary": 3.0, "base": 0.0}
    promotions.pin("canary", None)
    assert weights == {"canary": 100.0, "base": 0.0}


def test_request_classes() -> None:
    assert request_class(0.0, 10) == "greedy/short"
    assert request_class(None, 600) == "sampled/long"
    assert request_class(0.7, 511) == "sampled/short"


POOLS: list[dict[str, Any]] = [
    {"name": "base", "model": "m", "workers": ["http://a:1"]},
    {"name": "canary", "model": "m", "workers": ["http://b:1"], "promotion": {"baseline": "base"}},
]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"stages": [10, 150]}, "150 is not a weight in (0, 100]"),
        ({"stages": [50, 25, 100]}, "stages must increase"),
        ({"stages": [10, 50]}, "must end at 100"),
        ({"baseline": "nope"}, "promotion.baseline: no pool named 'nope'"),
        ({"baseline": "canary"}, "is not another pool of its model"),
        ({"min_samples": -3}, "min_samples"),
        ({"alpha": 0.9}, "alpha"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_a_bad_promotion_is_refused_at_startup_naming_the_field(
    change: dict[str, Any], message: str
) -> None:
    pools = [POOLS[0], {**POOLS[1], "promotion": {"baseline": "base", **change}}]
    with pytest.raises(ValidationError) as info:
        GatewaySettings(pools=pools)
    assert message in str(info.value)


def test_a_weight_beside_a_promotion_is_refused() -> None:
    with pytest.raises(ValidationError, match="weight is set by the promotion"):
        GatewaySettings(pools=[{**POOLS[0], "weight": 90}, POOLS[1]])
    GatewaySettings(pools=POOLS)  # without: accepted


def test_a_tally_survives_its_flat_fields_as_summed_across_replicas() -> None:
    one, two = Tally(), Tally()
    one.record("canary", "greedy/short", 100.0, 4.0)
    two.record("canary", "greedy/short", 120.0, 5.0)
    two.record("base", "sampled/long", 50.0, None)
    two.fail("base")
    summed = {
        k: one.fields().get(k, 0.0) + two.fields().get(k, 0.0)
        for k in {*one.fields(), *two.fields()}
    }
    back = Tally.from_fields(summed)
    assert back.requests == {"canary": 2, "base": 1} and back.errors == {"base": 1}
    assert back.speeds["canary"]["greedy/short"].n == 2
    assert back.speeds["canary"]["greedy/short"].mean == pytest.approx(
        (math.log(100) + math.log(120)) / 2
    )
    assert back.acceptance["canary"].mean == 4.5 and "base" not in back.acceptance
