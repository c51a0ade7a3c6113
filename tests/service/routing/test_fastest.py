"""ROUTING=fastest: the speed map's choice, and through the real gateway, greedy and sampled
requests each sent to the pool that serves their class fastest."""

from __future__ import annotations

import logging
import math
from collections import Counter

import httpx
import pytest

from service.routing.fastest import (
    ALONE_READ_UP_TO,
    EXPLORATION_PRICE_POWER,
    HARM_FLOOR,
    HARM_GAIN_FLOOR,
    HARM_MIN_SAMPLES,
    HARM_OVERLAP,
    MIN_SAMPLES,
    MOSTLY_MIXED,
    SMOOTHING,
    UNSEEN_SLOPE,
    PoolLoad,
    SpeedMap,
    load_level,
    pool_loads,
    speed_map,
)
from service.routing.fleet import Worker
from service.settings import GatewaySettings
from tests.service.conftest import running_gateway
from tests.service.fake_upstream import MODEL, Handler, fake_worker
from tests.service.routing.test_promotion_gateway import reporting

GREEDY, SAMPLED = "greedy/short", "sampled/short"
EVEN = {"dflash": 1.0, "plain": 1.0}


def taught(speed_map: SpeedMap, klass: str, load: float, **speeds: float) -> SpeedMap:
    """pool=tokens/s for `klass` at `load` in flight per worker."""
    for pool, speed in speeds.items():
        for _ in range(MIN_SAMPLES):
            speed_map.observe(pool, klass, load, speed)
    return speed_map


def busy(**in_flight: int) -> dict[str, PoolLoad]:
    """pool=requests in flight on its one worker."""
    return {pool: PoolLoad(1, n) for pool, n in in_flight.items()}


def test_the_pool_expected_fastest_at_its_load_is_chosen() -> None:
    speed_map = taught(SpeedMap(exploration=0.0), GREEDY, 1, dflash=200.0, plain=100.0)
    assert speed_map.choose(GREEDY, busy(dflash=0, plain=0), EVEN) == "dflash"
    taught(speed_map, GREEDY, 4, dflash=80.0, plain=95.0)  # at 4 in flight DFlash is slower
    assert speed_map.choose(GREEDY, busy(dflash=3, plain=3), EVEN) == "plain"
    # Between loads with evidence, log-log interpolated; beyond them, the nearest one's.
    assert speed_map.log_speed("dflash", GREEDY, 2) == pytest.approx(math.log(200 * 80) / 2)
    assert speed_map.log_speed("dflash", GREEDY, 16) == pytest.approx(math.log(80.0))
    assert speed_map.choose(GREEDY, busy(dflash=1, plain=1), EVEN) == "dflash"  # 126 vs 97
    assert speed_map.choose(GREEDY, busy(dflash=3, plain=0), EVEN) == "plain"  # 80 vs 100


def test_a_class_leans_to_the_pool_of_its_comparative_advantage() -> None:
    """Alone, greedy requests run 400 tokens/s on DFlash and 160 on plain, sampled ones 150
    and 160. Centred over the classes, the greedy class gains half the log of 400/150 on
    DFlash and nothing on plain; centred over the pools as well, a quarter of it on DFlash,
    and the sampled class as much on plain. At the default bias, 1.0, a request leaves its
    class's home only for a pool faster for it by more than (400/150) ** (1 / 4), 1.28x."""
    speed_map = SpeedMap(exploration=0.0)
    taught(speed_map, GREEDY, 1, dflash=400.0, plain=160.0)
    taught(speed_map, SAMPLED, 1, dflash=150.0, plain=160.0)
    pools = ["dflash", "plain"]
    assert speed_map.class_edges(pools)[GREEDY] == pytest.approx(
        {"dflash": math.log(400 / 150) / 2, "plain": 0.0}
    )
    quarter = math.log(400 / 150) / 4
    assert speed_map.advantage(GREEDY, pools) == pytest.approx(
        {"dflash": quarter, "plain": -quarter}
    )
    assert speed_map.advantage(SAMPLED, pools) == pytest.approx(
        {"dflash": -quarter, "plain": quarter}
    )
    taught(speed_map, GREEDY, 3, dflash=140.0)  # DFlash with 2 in flight: 160 / 140 = 1.14
    assert speed_map.choose(GREEDY, busy(dflash=2, plain=0), EVEN) == "dflash"
    speed_map.home_bias = 0.0  # each request to the pool fastest for itself: the rule before
    assert speed_map.choose(GREEDY, busy(dflash=2, plain=0), EVEN) == "plain"
    speed_map.home_bias = 1.0
    taught(speed_map, GREEDY, 6, dflash=100.0)  # DFlash with 5 in flight: 1.6x, it leaves
    assert speed_map.choose(GREEDY, busy(dflash=5, plain=0), EVEN) == "plain"
    # The sampled class's home is the plain pool: it stays there for 150 / 130 = 1.15x ...
    taught(speed_map, SAMPLED, 2, plain=130.0)
    assert speed_map.choose(SAMPLED, busy(dflash=0, plain=1), EVEN) == "plain"
    # ... and joins DFlash when the plain pool is crowded: 150 / 90 = 1.67x.
    taught(speed_map, SAMPLED, 4, plain=90.0)
    assert speed_map.choose(SAMPLED, busy(dflash=0, plain=3), EVEN) == "dflash"
    # One class only, or classes alike: no advantage, each request where it is fastest.
    assert SpeedMap().advantage(GREEDY, pools) == {"dflash": 0.0, "plain": 0.0}
    alike = SpeedMap(exploration=0.0)
    taught(alike, GREEDY, 1, dflash=300.0, plain=150.0)
    taught(alike, SAMPLED, 1, dflash=300.0, plain=150.0)
    assert alike.advantage(SAMPLED, pools) == pytest.approx({"dflash": 0.0, "plain": 0.0})


def test_a_pool_already_mixed_on_every_worker_costs_its_home_class_nothing_more() -> None:
    """The sampled class keeps off a DFlash pool whose batch drafts for greedy requests
    (1.28x, the test above). Where every DFlash worker already holds a sampled request, and
    did for most recent requests, its greedy rows run plain already: the next sampled
    request goes where it is fastest for itself, and so may a greedy one where the plain
    pool holds a greedy request."""
    speed_map = SpeedMap(exploration=0.0)
    taught(speed_map, GREEDY, 1, dflash=400.0, plain=160.0)
    taught(speed_map, SAMPLED, 1, dflash=150.0, plain=160.0)
    taught(speed_map, SAMPLED, 2, dflash=140.0, plain=130.0)  # 1.08x faster on DFlash
    holding = {"dflash": {GREEDY: 1}, "plain": {SAMPLED: 1}}
    pure = {pool: PoolLoad(1, 1, (held,)) for pool, held in holding.items()}
    assert speed_map.choose(SAMPLED, pure, EVEN) == "plain"
    mixed = {**pure, "dflash": PoolLoad(1, 1, ({GREEDY: 1, SAMPLED: 1},))}
    # Not for the first sampled request that got in: only once the pool has been found
    # mixed by MOSTLY_MIXED of the recent requests that found it busy (a moving average).
    looks = math.ceil(math.log(1 - MOSTLY_MIXED) / math.log(1 - SMOOTHING))
    for _ in range(looks - 1):
        assert speed_map.choose(SAMPLED, mixed, EVEN) == "plain"
    assert speed_map.choose(SAMPLED, mixed, EVEN) == "dflash"
    assert speed_map.mixed_share["dflash"] >= MOSTLY_MIXED > speed_map.mixed_share["plain"]
    share = speed_map.mixed_share["dflash"]
    idle = {**pure, "dflash": PoolLoad(1, 0, ({},))}
    speed_map.choose(SAMPLED, idle, EVEN)  # a burst onto an idle worker: not counted
    assert speed_map.mixed_share["dflash"] == share
    only_sampled = {**pure, "dflash": PoolLoad(1, 1, ({SAMPLED: 1},))}
    assert speed_map.choose(SAMPLED, only_sampled, EVEN) == "dflash"
    # Two DFlash workers, one of them still drafting for greedy requests only: kept off.
    half = {**pure, "dflash": PoolLoad(2, 2, ({SAMPLED: 1}, {GREEDY: 1}))}
    assert speed_map.choose(SAMPLED, half, EVEN) == "plain"
    # A class with no advantage anywhere (no evidence alone) is away from no pool.
    unknown = {**pure, "dflash": PoolLoad(1, 1, ({"greedy/long": 1},))}
    assert speed_map.choose(SAMPLED, unknown, EVEN) == "plain"
    # The greedy class: DFlash 2 in flight at 140 tokens/s, plain alone at 160 (1.14x).
    taught(speed_map, GREEDY, 3, dflash=140.0)
    two = {
        "dflash": PoolLoad(1, 2, ({GREEDY: 1},)),
        "plain": PoolLoad(1, 0, ({},)),
    }
    assert speed_map.choose(GREEDY, two, EVEN) == "dflash"
    taught(speed_map, GREEDY, 2, plain=150.0)  # plain holding a greedy request: 1.07x
    mixed_plain = {**two, "plain": PoolLoad(1, 1, ({GREEDY: 1},))}
    speed_map.mixed_share["plain"] = 1.0
    assert speed_map.choose(GREEDY, mixed_plain, EVEN) == "plain"


def test_beyond_its_evidence_a_class_declines_as_the_pools_other_classes_do(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The live bench's c = 16 (dflash-bench fleet): sampled requests were seen on DFlash
    only alone (167 tokens/s), and read flat that is what they would run at 7 in flight,
    against 107 on the plain pool at 10: 1.56x, past the lean, into the greedy batch. Greedy
    requests there fall from 460 alone to 165 at 9 in flight, and so, beyond its own
    evidence, does a sampled request's estimate."""
    speed_map = SpeedMap(exploration=0.0)
    taught(speed_map, SAMPLED, 1, dflash=167.0, plain=170.0)
    taught(speed_map, SAMPLED, 10, plain=107.0)
    taught(speed_map, GREEDY, 1, dflash=460.0, plain=161.0)
    taught(speed_map, GREEDY, 9, dflash=165.0)
    assert math.exp(speed_map.log_speed("dflash", SAMPLED, 9) or 0) == pytest.approx(
        167 * 165 / 460
    )
    with caplog.at_level(logging.DEBUG, logger="dflash.gateway.fastest"):
        assert speed_map.choose(SAMPLED, busy(dflash=6, plain=9), EVEN) == "plain"
    assert caplog.messages[-1] == (
        "sampled/short to plain: dflash at 7 in flight: 67 tokens/s, advantage -0.267, "
        "plain at 10 in flight: 107 tokens/s, advantage +0.267"
    )
    flat = SpeedMap(exploration=0.0, estimates=speed_map.estimates, classes={SAMPLED})
    assert math.exp(flat.log_speed("dflash", SAMPLED, 9) or 0) == pytest.approx(167)
    # Within its evidence, or where no other class has any this far: its own, as before.
    assert math.exp(speed_map.log_speed("plain", SAMPLED, 10) or 0) == pytest.approx(107)
    assert math.exp(speed_map.log_speed("plain", GREEDY, 12) or 0) == pytest.approx(161)
    # Nor does a class that speeds up with load lift another's estimate.
    taught(speed_map, GREEDY, 16, plain=200.0)
    assert math.exp(speed_map.log_speed("plain", SAMPLED, 16) or 0) == pytest.approx(107)


def test_in_a_burst_onto_loads_never_seen_each_class_goes_home() -> None:
    """The live bench's c = 32 warm-up: 32 requests routed within milliseconds, onto loads
    no class had been seen at. Read flat, a sampled request expected 187 tokens/s on DFlash
    (seen there alone) at 9 in flight, 1.38x the plain pool's 136 at 3, past the lean
    (1.18x here): sampled requests piled into the greedy batch. Away from home, where no
    class has been seen at such a load, the pool's tokens/s is held instead."""
    speed_map = SpeedMap(exploration=0.0)
    taught(speed_map, GREEDY, 1, dflash=460.0, plain=215.0)
    taught(speed_map, SAMPLED, 1, dflash=187.0, plain=170.0)
    taught(speed_map, GREEDY, 4, dflash=156.0)
    taught(speed_map, SAMPLED, 3, plain=136.0)
    assert math.exp(speed_map.log_speed("dflash", SAMPLED, 9) or 0) == pytest.approx(187)
    held = speed_map.log_speed("dflash", SAMPLED, 9, UNSEEN_SLOPE) or 0
    assert math.exp(held) == pytest.approx(187 / 9)
    assert speed_map.choose(SAMPLED, busy(dflash=8, plain=2), EVEN) == "plain"
    # At home, as fast as at the highest load seen: 156 on DFlash at 9 against plain's 172
    # (215 alone, falling as the sampled requests there fall to 3 in flight), within the lean.
    assert speed_map.choose(GREEDY, busy(dflash=8, plain=2), EVEN) == "dflash"
    # Crowded enough, home is left: DFlash at 9 against an idle plain worker, 1.38x.
    assert speed_map.choose(GREEDY, busy(dflash=8, plain=0), EVEN) == "plain"


def test_no_estimate_or_exploring_routes_by_weights() -> None:
    """Exploring (the first draw under the share) goes to the pool drawn by weight (the
    second draw: 0.1 is dflash, 0.9 plain) where a worker of it is idle; onto a pool it
    expects to run x times slower on, at odds x ** EXPLORATION_PRICE_POWER (the third draw);
    else the rule."""
    draws: list[float] = []
    speed_map = taught(SpeedMap(draw=lambda: draws.pop(0)), GREEDY, 1, dflash=200.0)
    draws[:] = [0.01, 0.9]  # exploring, and plain has no estimate: exploring it
    assert speed_map.choose(GREEDY, busy(dflash=0, plain=0), EVEN) == "plain"
    draws[:] = [0.9, 0.9]  # not exploring, but plain has no estimate: by weights
    assert speed_map.choose(GREEDY, busy(dflash=0, plain=0), EVEN) == "plain"
    taught(speed_map, GREEDY, 1, plain=100.0)
    odds = 0.5**EXPLORATION_PRICE_POWER  # half as fast on plain: 0.25 at power 2
    draws[:] = [0.01, 0.9, odds - 0.01]  # exploring, plain idle, within the odds
    assert speed_map.choose(GREEDY, busy(dflash=0, plain=0), EVEN) == "plain"
    draws[:] = [0.01, 0.9, odds + 0.01]  # beyond them: the rule's pool
    assert speed_map.choose(GREEDY, busy(dflash=0, plain=0), EVEN) == "dflash"
    assert 0.2 < odds < 0.3
    draws[:] = [0.01, 0.1]  # exploring the pool the rule picks: no third draw
    assert speed_map.choose(GREEDY, busy(dflash=0, plain=0), EVEN) == "dflash"
    draws[:] = [0.01, 0.9]  # exploring, plain busy: it would slow the request there
    assert speed_map.choose(GREEDY, busy(dflash=0, plain=1), EVEN) == "dflash"
    draws[:] = [0.9]
    assert speed_map.choose(GREEDY, busy(dflash=0, plain=0), EVEN) == "dflash"
    draws[:] = [0.9, 0.5]  # a class without estimates: by weights
    assert speed_map.choose(SAMPLED, busy(dflash=0), {"dflash": 1.0}) == "dflash"


def test_under_load_exploring_goes_to_a_pool_no_busier_than_the_rules_pick() -> None:
    """No worker idle (sustained load): an exploring request goes to the drawn pool if it
    holds no more requests per worker than the rule's pick and is not away from the class's
    home (any pool, with no advantage read), at its price; else estimates formed in a
    gateway's first crowd are never refreshed (live, the sampled class read 106 tokens/s on
    the plain pool from its first burst and never went there again)."""
    draws: list[float] = []
    speed_map = SpeedMap(draw=lambda: draws.pop(0))
    taught(speed_map, SAMPLED, 10, dflash=120.0, plain=106.0)  # no advantage read
    odds = (106 / 120) ** EXPLORATION_PRICE_POWER
    draws[:] = [0.9]  # not exploring: the rule's pool
    assert speed_map.choose(SAMPLED, busy(dflash=8, plain=8), EVEN) == "dflash"
    draws[:] = [0.01, 0.9, odds - 0.01]  # exploring plain, as busy as DFlash, within the odds
    assert speed_map.choose(SAMPLED, busy(dflash=8, plain=8), EVEN) == "plain"
    draws[:] = [0.01, 0.9, odds + 0.01]  # beyond them
    assert speed_map.choose(SAMPLED, busy(dflash=8, plain=8), EVEN) == "dflash"
    draws[:] = [0.01, 0.9]  # plain busier than the rule's pick: no third draw
    assert speed_map.choose(SAMPLED, busy(dflash=8, plain=9), EVEN) == "dflash"
    assert not draws
    # With an advantage read, never onto a busy pool away from the class's home: a sampled
    # request into a DFlash batch stops its greedy rows drafting.
    taught(speed_map, GREEDY, 1, dflash=440.0, plain=180.0)
    taught(speed_map, SAMPLED, 1, dflash=175.0, plain=180.0)
    draws[:] = [0.01, 0.1]
    assert speed_map.choose(SAMPLED, busy(dflash=4, plain=8), EVEN) == "plain"
    assert not draws


def harmed(
    speed_map: SpeedMap, pool: str, klass: str, harm: float, gain: float | None = 3.0, n: int = 300
) -> SpeedMap:
    """`n` requests of `klass` on `pool`, at 6-10 in flight, that ran exp(harm) times slower
    with another class in flight throughout than with none (a 5 % spread), each accepting
    `gain` draft tokens per drafting step."""
    for i in range(n):
        mixed, load = (i % 5) / 4, 6 + 2 * (i % 3)
        spread = 1 + 0.05 * ((i * 7) % 11 - 5) / 5
        speed = 150 * (8 / load) ** 0.5 * math.exp(-harm * mixed) * spread
        speed_map.observe(pool, klass, load, speed, mixed=mixed, gain=gain)
    return speed_map


def test_a_class_is_harmed_where_another_class_on_its_worker_slows_it_and_it_drafts() -> None:
    """The harm: how much slower a class runs on a pool with another class in flight on its
    worker throughout than with none, at the same load, read at load from the share of each
    request's life it was mixed. Only where the class gains by drafting (a plain pool, or
    sampled rows accepting little, cannot lose drafting), at HARM_FLOOR or more, known to
    within HARM_FLOOR / HARM_T."""
    greedy_on_dflash = harmed(SpeedMap(), "dflash", GREEDY, 0.3)
    assert greedy_on_dflash.harm("dflash", GREEDY) == pytest.approx(0.3, abs=0.03)
    assert greedy_on_dflash.harm("plain", GREEDY) == 0.0  # no evidence
    assert harmed(SpeedMap(), "plain", GREEDY, 0.3, gain=None).harm("plain", GREEDY) == 0.0
    little = harmed(SpeedMap(), "dflash", SAMPLED, 0.3, gain=HARM_GAIN_FLOOR / 2)
    assert little.harm("dflash", SAMPLED) == 0.0
    assert harmed(SpeedMap(), "dflash", GREEDY, HARM_FLOOR / 2).harm("dflash", GREEDY) == 0.0
    assert (
        harmed(SpeedMap(), "dflash", GREEDY, 0.3, n=HARM_MIN_SAMPLES - 1).harm("dflash", GREEDY)
        == 0.0
    )
    # Mixed more at the higher loads, and slowed by the load only: no harm (the fit holds the
    # load, which a plain mean of mixed against unmixed speeds would not).
    by_load = SpeedMap()
    for i in range(300):
        load = 4 + 2 * (i % 5)
        mixed = (load - 4) / 16 + (i % 3) / 4
        by_load.observe("dflash", GREEDY, load, 600 / load, mixed=mixed, gain=3.0)
    assert by_load.harm("dflash", GREEDY) == 0.0
    assert by_load.harms["dflash", GREEDY].slope == pytest.approx(0.0, abs=0.02)
    # A harm read stays while the other class keeps away and the mix no longer varies.
    for _ in range(600):
        greedy_on_dflash.observe("dflash", GREEDY, 8, 150.0, mixed=0.0, gain=3.0)
    assert greedy_on_dflash.harm("dflash", GREEDY) == pytest.approx(0.3, abs=0.03)


def test_a_request_pays_for_the_harm_it_brings_the_rows_it_joins() -> None:
    """A sampled request joining a DFlash batch of greedy rows keeps them from drafting; a
    greedy one joining sampled rows costs them nothing. Nothing on an idle worker; on one
    already mixed, the time it prolongs the mix (1 / (1 + the rows already harming)); at the
    scale of one row of the batch it joins. Live, from a start at c = 16 with three quarters of
    the traffic greedy, the sampled class split by its own speed, within a few percent on the
    two pools, and the greedy class ran 0.87x (runs Z2, Z3, loadtest/RESULTS.md)."""
    speed_map = harmed(SpeedMap(exploration=0.0), "dflash", GREEDY, 0.3)
    harm = speed_map.harm("dflash", GREEDY)
    four = PoolLoad(1, 4, ({GREEDY: 4},))
    assert speed_map.harm_brought(SAMPLED, "dflash", four) == pytest.approx(
        HARM_OVERLAP * 4 * harm / 5
    )
    assert speed_map.harm_brought(GREEDY, "dflash", four) == 0.0
    assert speed_map.harm_brought(GREEDY, "dflash", PoolLoad(1, 4, ({SAMPLED: 4},))) == 0.0
    assert speed_map.harm_brought(SAMPLED, "dflash", PoolLoad(1, 0, ({},))) == 0.0
    mixed = PoolLoad(1, 5, ({GREEDY: 4, SAMPLED: 1},))
    assert speed_map.harm_brought(SAMPLED, "dflash", mixed) == pytest.approx(
        HARM_OVERLAP * 4 * harm / 2 / 6
    )
    # Least outstanding sends it to the least busy worker: that one's rows.
    two = PoolLoad(2, 6, ({GREEDY: 4}, {SAMPLED: 2}))
    assert speed_map.harm_brought(SAMPLED, "dflash", two) == 0.0
    # No advantage read (a start under load): 1.03x faster for itself on DFlash, a sampled
    # request goes to the plain pool while the DFlash batch is all greedy; a greedy one, and
    # a sampled one where no harm was read, where each is fastest.
    taught(speed_map, SAMPLED, 8, dflash=103.0, plain=100.0)
    taught(speed_map, GREEDY, 8, dflash=130.0, plain=100.0)
    held = {"dflash": PoolLoad(1, 7, ({GREEDY: 7},)), "plain": PoolLoad(1, 7, ({SAMPLED: 7},))}
    assert speed_map.choose(SAMPLED, held, EVEN) == "plain"
    assert speed_map.choose(GREEDY, held, EVEN) == "dflash"
    unharmed = taught(SpeedMap(exploration=0.0), SAMPLED, 8, dflash=103.0, plain=100.0)
    taught(unharmed, GREEDY, 8, dflash=130.0, plain=100.0)
    assert unharmed.choose(SAMPLED, held, EVEN) == "dflash"


def test_the_alone_speed_is_read_from_requests_alone_throughout_else_ended_alone() -> None:
    """The advantage's alone speed: requests alone on their worker throughout (mean load 1);
    without MIN_SAMPLES of them, those that ended alone (a gateway started under load); else
    the lowest load seen."""
    speed_map = taught(SpeedMap(exploration=0.0), GREEDY, 2.5, dflash=150.0)
    assert speed_map.alone("dflash", GREEDY) == pytest.approx(math.log(150.0))
    for _ in range(MIN_SAMPLES - 1):  # ended alone, after sharing the batch a while
        speed_map.observe("dflash", GREEDY, 1.6, 250.0, ended_alone=True)
    assert speed_map.alone("dflash", GREEDY) == pytest.approx(math.log(150.0))  # too few
    speed_map.observe("dflash", GREEDY, 1.6, 250.0, ended_alone=True)
    assert speed_map.alone("dflash", GREEDY) == pytest.approx(math.log(250.0))
    taught(speed_map, GREEDY, 1.0, dflash=400.0)  # alone throughout: these win
    assert speed_map.alone("dflash", GREEDY) == pytest.approx(math.log(400.0))
    assert speed_map.alone("plain", GREEDY) is None


def test_no_alone_speed_is_read_from_requests_that_ran_in_a_crowd() -> None:
    """A gateway started under load: requests that ended alone after a crowded life, and a
    lowest load beyond ALONE_READ_UP_TO, read no alone speed, and no advantage forms (the
    classes' mix in the batch decides those speeds; run W read the advantage reversed)."""
    speed_map = taught(SpeedMap(exploration=0.0), GREEDY, 7.5, dflash=100.0, plain=110.0)
    taught(speed_map, SAMPLED, 7.5, dflash=105.0, plain=100.0)
    for _ in range(2 * MIN_SAMPLES):
        speed_map.observe("dflash", GREEDY, 5.0, 120.0, ended_alone=True)
    assert speed_map.alone("dflash", GREEDY) is None
    assert speed_map.advantages(["dflash", "plain"]) == {}
    for _ in range(MIN_SAMPLES):  # ended alone, having shared its worker with few
        speed_map.observe("dflash", GREEDY, ALONE_READ_UP_TO, 300.0, ended_alone=True)
    assert speed_map.alone("dflash", GREEDY) == pytest.approx(math.log(300.0))
    taught(speed_map, SAMPLED, ALONE_READ_UP_TO, plain=150.0)  # the lowest load, at the bound
    assert speed_map.alone("plain", SAMPLED) == pytest.approx(math.log(150.0))


def test_load_levels_double() -> None:
    assert [load_level(x) for x in (1, 2, 3, 4, 5, 64, 65, 1000)] == [0, 1, 2, 2, 3, 6, 7, 7]
    a, b, c = (Worker(f"http://{n}:1", pool=p) for n, p in (("a", "x"), ("b", "x"), ("c", "y")))
    for _ in range(3):
        a.admit(GREEDY)
    b.admit(SAMPLED)
    loads = pool_loads([a, b, c])
    held = ({GREEDY: 3}, {SAMPLED: 1})
    assert loads == {"x": PoolLoad(2, 4, held), "y": PoolLoad(1, 0, ({},))}
    assert loads["x"].per_worker(1) == 2.5 and not loads["x"].idle and loads["y"].idle
    for _ in range(3):  # a's worker idle: least outstanding sends the next request there
        a.release(GREEDY)
    assert pool_loads([a, b])["x"] == PoolLoad(2, 1, ({}, {SAMPLED: 1}))
    assert pool_loads([a, b])["x"].idle


def test_the_map_is_made_for_fastest_routing_only() -> None:
    made = speed_map(GatewaySettings(routing="fastest", fastest_home_bias=1.5))
    assert made is not None and made.home_bias == 1.5 and made.exploration == 0.05
    assert speed_map(GatewaySettings(routing="prefix_affinity")) is None


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
