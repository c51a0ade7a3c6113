"""`ROUTING=fastest`: each request to the pool of its model where it is expected to decode
fastest, at that pool's current load (docs/gateway.md, "Each request to its fastest pool").

Speculation's value moves with load and with traffic: a DFlash pool that doubles a greedy
request's speed at low load may be slower than plain decoding at c >= 8, or for sampled
requests. So the gateway learns, online, each pool's decode speed per request class and load
level from the per-request reports (the same ones promotion reads), and sends each request to
the pool with the highest expected speed at the load it would join. Lossless speculation makes
this safe: every pool of a model gives the same output distribution.

- Load is a pool's requests in flight per routable worker (the gateway's own count, the most
  current signal there is), in levels that double: 1, 2, 4, ... 64 and more.
- An estimate is a moving average of log tokens/s (recent requests weigh more: speed drifts
  with the traffic), per (pool, class, level); a level without evidence borrows a neighbour's.
- A share of requests (`fastest_exploration`, 5 %) and every request for which some pool has
  no estimate yet go by the pools' weights, drawn at random: that is how evidence is
  gathered, and how a pool that got slow gets a chance to show it is fast again.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from service.routing.split import effective_weights

# Upper bounds of the load levels (requests in flight per worker, this request included).
LEVELS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
# The weight of each new sample in a moving average (about the last 50 requests count).
SMOOTHING = 0.02
# Samples before an estimate is used (the first few are noisy).
MIN_SAMPLES = 5


def load_level(in_flight_per_worker: float) -> int:
    return bisect.bisect_left(LEVELS, in_flight_per_worker)


@dataclass
class Estimate:
    mean: float = 0.0  # log tokens/s
    n: int = 0

    def add(self, value: float) -> None:
        self.n += 1
        rate = max(SMOOTHING, 1.0 / self.n)  # a plain mean until it has 1/SMOOTHING samples
        self.mean += rate * (value - self.mean)


@dataclass
class SpeedMap:
    exploration: float = 0.05
    draw: Callable[[], float] = random.random
    estimates: dict[tuple[str, str, int], Estimate] = field(default_factory=dict)

    def observe(self, pool: str, klass: str, level: int, speed: float) -> None:
        if speed > 0 and math.isfinite(speed):
            key = (pool, klass, level)
            self.estimates.setdefault(key, Estimate()).add(math.log(speed))

    def expected(self, pool: str, klass: str, level: int) -> float | None:
        """log tokens/s expected at this level; the nearest level's (lower first) without one."""
        for distance in range(len(LEVELS) + 1):
            for near in (level - distance, level + distance):
                found = self.estimates.get((pool, klass, near))
                if found is not None and found.n >= MIN_SAMPLES:
                    return found.mean
        return None

    def choose(self, klass: str, levels: Mapping[str, int]) -> str | None:
        """The pool expected fastest for this class at the level it would join; None: route
        by weights (exploring, or no estimate for some pool yet)."""
        if self.draw() < self.exploration:
            return None
        expected = {pool: self.expected(pool, klass, level) for pool, level in levels.items()}
        if any(value is None for value in expected.values()):
            return None
        return max(sorted(expected), key=lambda pool: expected[pool] or 0.0)


class Loaded(Protocol):
    """What a load level reads of a worker (service/routing/fleet.py's Worker)."""

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


def pool_levels(workers: Iterable[Loaded], extra: int = 1) -> dict[str, int]:
    """Each pool's load level: its requests in flight (plus `extra`, the one being routed)
    over its workers."""
    in_flight: dict[str, int] = {}
    count: dict[str, int] = {}
    for worker in workers:
        in_flight[worker.pool] = in_flight.get(worker.pool, 0) + worker.outstanding
        count[worker.pool] = count.get(worker.pool, 0) + 1
    return {pool: load_level((in_flight[pool] + extra) / count[pool]) for pool in count}
