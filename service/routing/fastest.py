"""`ROUTING=fastest`: each request to the pool of its model where it is expected to decode
fastest, leaning to the pool its class serves the fleet best on (docs/gateway.md, "Each
request to its fastest pool").

Speculation's value moves with load and with traffic: a DFlash pool that doubles a greedy
request's speed at low load may be no faster than plain decoding at c >= 8, or for sampled
requests. So the gateway learns, online, each pool's decode speed per request class and load
from the per-request reports (the same ones promotion reads). Lossless speculation makes any
choice safe: every pool of a model gives the same output distribution.

The rule: a request of class k goes to the pool with the highest

    score(p) = log s(p, k, n_p + 1) + home_bias * max(advantage(p, k), 0)

s(p, k, n) its expected tokens/s on pool p at n requests in flight per worker (its own speed
where it would join), advantage(p, k) its class's comparative advantage there: log s(p, k, 1)
less the mean over the classes of log s(p, j, 1), how much faster than the pool's other
classes it runs, each alone on a worker. With one class, or classes alike, it is the rule
before: each request to the pool fastest for itself.

Why (issue 47; tests/service/routing/test_fastest_simulation.py runs both rules through a
closed-loop model of the pools `dflash-bench fleet` measured). Each request maximising its own
speed ignores what it costs the others, and so did its exploration:
- Exploring by weights at any load sent 2.5 % of the greedy requests to the plain pool and of
  the sampled ones into the DFlash batch, where a sampled request is a plain row every
  drafting row waits for, and a slow one: it stays. That cost 6-8 % at c = 4 in the model. Now
  an exploring request (`fastest_exploration`, 5 %, drawn by the pools' weights) goes to the
  drawn pool only where a worker of it is idle: it slows no one, and its speed is the one the
  advantage is read at. Otherwise it is routed by the rule.
- At c = 32 the DFlash batch of greedy requests runs plain, a greedy request is faster on the
  plain pool, and greedy requests moved there: the fleet gained 0.2 %, the sampled requests
  on that pool ran at 0.87x. The lean keeps a class on the pool it has the comparative
  advantage on until another is faster for it by more than exp(home_bias * advantage)
  (1.28x for greedy requests on a DFlash pool beside a plain one, at the default 0.5).
- The lean is to a class's home, never away from a pool: a DFlash pool can serve the fleet
  best running plain for a crowd of sampled requests (25 % greedy traffic at c = 16: 1.03x
  the best static split when the sampled requests may join it, 0.96x, sampled requests at
  0.76x, when a negative advantage kept them out).
- The advantage is read alone (one request per worker), where no mix of classes confounds it:
  at load, a greedy request's speed on DFlash depends on who shares its batch. For the same
  reason not the marginal throughput (own speed plus the change in speed of the requests
  already there): it needs differences between per-level estimates, which that confounding
  swamps (in the model, 0.81x the split by class at c = 4 and 0.83x at c = 32, exploring
  the same way: worse than the rule before).

- Load is a pool's requests in flight per routable worker (the gateway's own count, the most
  current signal there is); estimates are kept in levels that double: 1, 2, 4, ... 64 and
  more.
- An estimate is a moving average of log tokens/s and of the log load it was measured at
  (recent requests weigh more: speed drifts with the traffic), per (pool, class, level). The
  speed at a load is interpolated (log-log) between the levels with evidence, the nearest
  one's beyond them.
- Every request for which some pool has no estimate yet goes by weights, at any load: that is
  how the first evidence forms. A gateway that has never seen a worker idle reads the
  advantage at the lowest loads it saw, where the mix of classes may hide it.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from service.routing.split import effective_weights
from service.settings import GatewaySettings

# Upper bounds of the load levels (requests in flight per worker, this request included).
LEVELS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
# The weight of each new sample in a moving average (about the last 50 requests count).
SMOOTHING = 0.02
# Samples before an estimate is used (the first few are noisy).
MIN_SAMPLES = 5
# The load the comparative advantage is read at: one request per worker, alone.
ALONE = 1.0


def load_level(in_flight_per_worker: float) -> int:
    return bisect.bisect_left(LEVELS, in_flight_per_worker)


@dataclass
class Estimate:
    mean: float = 0.0  # log tokens/s
    load: float = 0.0  # log requests in flight per worker, where its samples ran
    n: int = 0

    def add(self, value: float, load: float) -> None:
        self.n += 1
        rate = max(SMOOTHING, 1.0 / self.n)  # a plain mean until it has 1/SMOOTHING samples
        self.mean += rate * (value - self.mean)
        self.load += rate * (load - self.load)


@dataclass(frozen=True)
class PoolLoad:
    """A pool's routable workers and its requests in flight on them."""

    workers: int
    in_flight: int

    def per_worker(self, extra: int = 0) -> float:
        return (self.in_flight + extra) / max(self.workers, 1)

    @property
    def idle(self) -> bool:
        """Some worker has nothing in flight (least outstanding then picks it)."""
        return self.in_flight < self.workers


@dataclass
class SpeedMap:
    exploration: float = 0.05
    home_bias: float = 0.5
    draw: Callable[[], float] = random.random
    estimates: dict[tuple[str, str, int], Estimate] = field(default_factory=dict)
    classes: set[str] = field(default_factory=set)

    def observe(self, pool: str, klass: str, load: float, speed: float) -> None:
        """One request's decode speed (tokens/s), which ran at `load` requests in flight per
        worker (itself included)."""
        if speed > 0 and math.isfinite(speed) and load > 0:
            key = (pool, klass, load_level(load))
            self.estimates.setdefault(key, Estimate()).add(math.log(speed), math.log(load))
            self.classes.add(klass)

    def log_speed(self, pool: str, klass: str, load: float) -> float | None:
        """Expected log tokens/s at `load` in flight per worker: interpolated between the
        levels with evidence, the nearest one's beyond them; None without any."""
        at = math.log(max(load, 1e-9))
        below: Estimate | None = None
        for level in range(len(LEVELS) + 1):
            found = self.estimates.get((pool, klass, level))
            if found is None or found.n < MIN_SAMPLES:
                continue
            if found.load >= at:
                if below is None or found.load - below.load < 1e-9:
                    return found.mean
                share = (at - below.load) / (found.load - below.load)
                return below.mean + share * (found.mean - below.mean)
            below = found
        return None if below is None else below.mean

    def advantage(self, klass: str, pools: Collection[str]) -> dict[str, float]:
        """Per pool, how much faster (log) `klass` runs alone there than the mean of the
        classes with evidence on every pool; zeros without another such class."""
        alone = {
            j: [self.log_speed(pool, j, ALONE) for pool in pools] for j in sorted(self.classes)
        }
        known = {j: speeds for j, speeds in alone.items() if None not in speeds}
        if klass not in known or len(known) < 2:
            return dict.fromkeys(pools, 0.0)
        edge = {}
        for i, pool in enumerate(pools):
            mean = sum(speeds[i] or 0.0 for speeds in known.values()) / len(known)
            edge[pool] = (known[klass][i] or 0.0) - mean
        return edge

    def choose(
        self, klass: str, loads: Mapping[str, PoolLoad], weights: Mapping[str, float]
    ) -> str:
        """The pool for a request of `klass`: by weights while some pool has no estimate for
        it, or exploring onto an idle worker; else by the score (the module's docstring)."""
        if self.draw() < self.exploration:
            drawn = drawn_by_weight(weights, self.draw)
            if loads[drawn].idle:
                return drawn
        own = {
            pool: self.log_speed(pool, klass, load.per_worker(1)) for pool, load in loads.items()
        }
        if any(value is None for value in own.values()):
            return drawn_by_weight(weights, self.draw)
        edge = self.advantage(klass, list(loads))
        score = {pool: (own[pool] or 0.0) + self.home_bias * max(edge[pool], 0.0) for pool in own}
        return max(sorted(score), key=lambda pool: score[pool])


def speed_map(settings: GatewaySettings) -> SpeedMap | None:
    """The fleet's speed map under ROUTING=fastest; None under any other routing."""
    if settings.routing != "fastest":
        return None
    return SpeedMap(settings.fastest_exploration, settings.fastest_home_bias)


class Loaded(Protocol):
    """What a pool's load reads of a worker (service/routing/fleet.py's Worker)."""

    pool: str
    outstanding: int


def drawn_by_weight(weights: Mapping[str, float], draw: Callable[[], float]) -> str:
    """A pool drawn at random in proportion to its weight: how `fastest` routes by weights.
    Random, not round robin: a round robin in step with a traffic pattern (greedy and sampled
    requests alternating) would show each pool one class only, and no estimate would form."""
    offered = effective_weights(weights)
    point = draw() * sum(offered.values())
    for pool in sorted(offered):
        point -= offered[pool]
        if point < 0:
            return pool
    return sorted(offered)[-1]


def pool_loads(workers: Iterable[Loaded]) -> dict[str, PoolLoad]:
    """Each pool's workers and requests in flight on them."""
    count: dict[str, int] = {}
    in_flight: dict[str, int] = {}
    for worker in workers:
        count[worker.pool] = count.get(worker.pool, 0) + 1
        in_flight[worker.pool] = in_flight.get(worker.pool, 0) + worker.outstanding
    return {pool: PoolLoad(count[pool], in_flight[pool]) for pool in count}
