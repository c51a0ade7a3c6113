"""`ROUTING=fastest`: each request to the pool of its model where it is expected to decode
fastest, leaning to the pool its class serves the fleet best on (docs/gateway.md, "Each
request to its fastest pool").

Speculation's value moves with load and with traffic: a DFlash pool that doubles a greedy
request's speed at low load may be no faster than plain decoding at c >= 8, or for sampled
requests. So the gateway learns, online, each pool's decode speed per request class and load
from the per-request reports (the same ones promotion reads). Lossless speculation makes any
choice safe: every pool of a model gives the same output distribution.

The rule: a request of class k goes to the pool with the highest

    score(p) = log s(p, k, n_p + 1) + home_bias * max(advantage(p, k), 0) - brought(p, k)

s(p, k, n) its expected tokens/s on pool p at n requests in flight per worker (its own speed
where it would join), advantage(p, k) its class's comparative advantage there, read from each
class's speed alone on a worker (one request per worker), a(p, k) = log s(p, k, 1):

    advantage(p, k) = a(p, k) - mean_j a(p, j) - mean_q (a(q, k) - mean_j a(q, j))

how much faster than the pool's other classes it runs there, less the same on the mean pool:
Ricardo's comparative advantage, centred over the classes and over the pools. Beside a plain
pool, greedy requests have it on a DFlash pool and sampled ones on the plain pool. With one
class, or classes alike, it is zero: each request to the pool fastest for itself.

Why (issue 47; tests/service/routing/test_fastest_simulation.py runs both rules through a
closed-loop model of the pools `dflash-bench fleet` measured). Each request maximising its own
speed ignores what it costs the others, and so did its exploration:
- Exploring by weights at any load sent 2.5 % of the greedy requests to the plain pool and of
  the sampled ones into the DFlash batch, where a sampled request is a plain row every
  drafting row waits for, and a slow one: it stays. That cost 6-8 % at c = 4 in the model. Now
  an exploring request (`fastest_exploration`, 5 %, drawn by the pools' weights) goes to the
  drawn pool only where a worker of it is idle: it slows no one, and its speed is the one the
  advantage is read at. Otherwise it is routed by the rule.
- Under sustained load no worker is ever idle, and a class's estimate on a pool it left is
  never refreshed: live, from a start at c = 16, the sampled class read 106-118 tokens/s on
  the plain pool from the first burst's requests (at 8-11 in flight, read flat below), the
  DFlash pool 115-130, and went nowhere else (run X, loadtest/RESULTS.md). So where none
  of the drawn pool's workers is idle, an exploring request still goes there if it is no
  busier, per worker, than the rule's pick and not away from the class's home (any pool,
  with no advantage read): it adds no more load there than the rule would elsewhere, and
  keeps sampled requests out of a DFlash batch whose greedy rows draft.
- And onto a pool it expects to run x times slower on, at odds x ** 2
  (EXPLORATION_PRICE_POWER). Alone at c = 1 every exploring request pays its own slowdown,
  and at the full share a greedy request explored the plain pool, 2.4x slower for it, as
  often as a sampled one the DFlash pool, about as fast for it (live, 2-3 % of each class
  crossed): 0.6-2.2 % of the stream's tokens/s in the model over six seeds, 0.2-0.3 % now
  that the greedy class explores there at a sixth of the share. Where the pools are alike,
  and the choice in doubt, exploring is cheap and at the full share; where one is far
  faster, the other's estimate is refreshed less often, and could seldom change the choice.
- At c = 32 the DFlash batch of greedy requests runs plain, a greedy request is faster on the
  plain pool, and greedy requests moved there: the fleet gained 0.2 %, the sampled requests
  on that pool ran at 0.87x. The lean keeps a class on the pool it has the comparative
  advantage on until another is faster for it by more than exp(home_bias * advantage)
  (about 1.25x for greedy requests on a DFlash pool beside a plain one, at the default 1.0).
- Centred over the pools too, so the sampled class has a home, the plain pool: since the
  DFlash worker keeps a batch with T = 1.0 rows plain unless every row gains (issue 48), a
  sampled request that joins the DFlash batch stops its greedy rows drafting. Centred over
  the classes only, the sampled class had no advantage anywhere and went wherever it was
  fastest for itself, often the DFlash pool: on the live bench (`dflash-bench fleet`,
  e4b7926) the greedy class ran 0.51x its speed under the split by class at c = 4, and the
  closed-loop model with that engine read the same (0.48x); centred over both, 1.00x. The
  lean is bounded: a sampled request still joins a DFlash pool about 1.25x faster for it
  (a crowd of sampled requests on the plain pool, a DFlash batch running plain anyway).
  The default home_bias 1.0 is the model's, with each speed learnt at the load it ran at
  (below), over six seeds: every class at 0.94x or more with a quarter, half or three
  quarters of the traffic greedy; at 0.75 the greedy class fell to 0.76x at c = 4 with a
  quarter greedy, and at 1.25 the sampled class to 0.905x at c = 16 with three quarters.
  (Learnt at the load as a request ended, the alone speeds were slowed by the mix, the
  advantage read smaller, and 1.5 was the least that held: the bias makes up for the
  advantage's scale.)
- The lean is waived where every pool away from the request's home already holds, on each of
  its workers, a request away from its own home there (a sampled request in the DFlash batch),
  and did for MOSTLY_MIXED of the recent requests that found it busy: what the lean spares
  that pool's home class is already lost, most of the time, and another such request costs it
  nothing more. The gateway counts each worker's requests in flight by class. Held whatever
  the pools held, the lean kept a crowd of sampled requests on the plain pool at c = 16 while
  the DFlash batch, holding sampled requests as well, ran plain anyway: live, a quarter of the
  traffic greedy, 0.948-0.963x the 50/50 split after learning through c = 1 and 4. Waived
  whenever the pool was mixed at that moment, 0.972x there, but at c = 4 sampled requests
  followed the first one in (21 % of them crossed) and the greedy class ran 0.78x: hence "most
  of the time" (at three quarters of all requests, the ramp of each burst, onto idle pools,
  kept the share low, and at c = 16 it read 0.939x). In the model: 1.023x the best static
  split at c = 16 with a quarter greedy (0.996x held), 1.060x with three quarters (1.020x),
  and the same at c = 1 and 4.
- brought(p, k), the harm a request brings the rows it joins: where the worker of p it would
  join holds rows of a class that runs slower with another class in flight (a DFlash batch's
  greedy rows, kept plain by a sampled row), each such row's harm, for HARM_OVERLAP of its
  life, over 1 + the rows already there that harm it (a row joining a batch already mixed
  prolongs the mix by the time it outlives them), at the scale of one row of the batch
  (divided by the rows after it joins). The harm is read at load, where the advantage
  cannot be: from a start under sustained load no request is alone, but the mix on a worker
  comes and goes, and each request reports the share of its life it was mixed
  (Worker.mixed_since). A moving least-squares fit of log speed on that share and the log
  load (Harm) gives the slope; it counts where known to within HARM_FLOOR / HARM_T, at
  HARM_FLOOR or more, and only for a class that gains by drafting there (accepted drafts per
  drafting step, HARM_GAIN_FLOOR): on a plain pool, or for sampled rows, a slope on the mix
  is a confound (in the model, 0.1-0.2 read there from noise and the drains' low loads).
  Asymmetric, as the engine is: a greedy row costs a batch of sampled rows nothing. Why:
  live, from a start at c = 16 with three quarters of the traffic greedy and no advantage
  read, the sampled class split by its own speed, within a few percent on the two pools,
  and the greedy class ran 0.87x its speed under the 50/50 split (runs Z2, Z3,
  loadtest/RESULTS.md). In the model from such a start (the bench's rounds, a 15 % spread
  per speed, drafting at load paying as live), the sampled class kept out of the DFlash
  batch in 7 of 8 seeds against 4 without it, 1.06x the stream's tokens/s over the eight
  (tests/service/routing/test_fastest_simulation.py); with a quarter greedy no harm reads
  (a few greedy rows, whose mix rarely varies) and nothing changes. It holds a good state;
  it cannot leave a bad one: where the classes have swapped pools, every greedy row on the
  DFlash pool is mixed throughout, and no harm can be read (live, one run of three).
  In units of one row, not the sum over the rows: counted in full, while the load a
  request adds (which the own-speed rule leaves out on every pool alike) is not, sampled
  requests crowded the plain pool with a quarter greedy (down to 0.95x in the model).
- The advantage is read alone (one request per worker), where no mix of classes confounds it:
  at load, a greedy request's speed on DFlash depends on who shares its batch. For the same
  reason not the marginal throughput (own speed plus the change in speed of the requests
  already there): it needs differences between per-level estimates, which that confounding
  swamps (in the model, 0.81x the split by class at c = 4 and 0.83x at c = 32, exploring
  the same way: worse than the rule before).

- Load is a pool's requests in flight per routable worker (the gateway's own count, the most
  current signal there is); estimates are kept in levels that double: 1, 2, 4, ... 64 and
  more.
- A request's speed is learnt at the load it ran at: the mean over its lifetime of the
  requests in flight on its worker (Worker.ran_at), not the count as it ended. Read at its end,
  a greedy request that shared the DFlash batch with a sampled one that left first counted as
  alone, and slowed: the advantage read alone shrank, and on the live bench 7 % of the sampled
  requests crossed into the DFlash pool at c = 4 (the greedy class at 0.93x). Read over its
  lifetime, alone means alone throughout, and none crossed at c = 4 or 16.
- An estimate is a moving average of log tokens/s and of the log load it was measured at
  (recent requests weigh more: speed drifts with the traffic), per (pool, class, level). The
  speed at a load is interpolated (log-log) between the levels with evidence, the lowest
  one's below them. Beyond the highest, a class's speed falls from there as the pool's other
  classes' speeds fall over the same loads; where no class has been seen at such a load, it
  holds at home and falls as 1 / load elsewhere (the pool's tokens/s held): in doubt, home.
  Read flat, as before, a class the lean keeps off a pool, seen there only alone, looked as
  fast at any load: on the live bench at c = 16 a sampled request read 167 tokens/s on a
  DFlash pool at 7 in flight, against 107 on the plain pool at 10, and joined the greedy
  batch; and in the burst that starts c = 32, sampled requests piled into DFlash and greedy
  ones into plain. In the closed-loop model with the bench's short windows (96 requests of
  warm-up, 128 measured at each c) and a 30 % spread on each observed speed, the worst of 20
  seeds at c = 4-32 went from 0.94x the best static split (the greedy class 0.83x) to 0.98x
  (0.94x).
- Every request for which some pool has no estimate yet goes by weights, at any load: that is
  how the first evidence forms. A gateway that has never seen a worker idle reads the
  advantage from the requests that ended alone, else at the lowest load it saw, but from
  neither beyond ALONE_READ_UP_TO in flight on average: there the mix of classes in each
  batch, not the class, sets a request's speed. Live, started at c = 16 with three quarters
  of the traffic greedy, the gateway read the greedy class's advantage on DFlash as -0.035 to
  -0.070 from such requests (run W: the classes swapped pools), or as +0.08 to +0.10 after
  learning longer (runs Y, Y2: 87-90 % of the greedy requests held on DFlash, 0.916-0.931x
  the 50/50 split). With no advantage read, each request goes where it is fastest for itself
  at its load until one is (runs Z1-Z3: 0.984-1.015x).
"""

from __future__ import annotations

import bisect
import logging
import math
import random
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from service.routing.split import effective_weights
from service.settings import GatewaySettings

log = logging.getLogger("dflash.gateway.fastest")

# Upper bounds of the load levels (requests in flight per worker, this request included).
LEVELS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
# The weight of each new sample in a moving average (about the last 50 requests count).
SMOOTHING = 0.02
# Samples before an estimate is used (the first few are noisy).
MIN_SAMPLES = 5
# The load the comparative advantage is read at: one request per worker, alone.
ALONE = 1.0
# The highest mean load an alone speed is read from when no request ran alone throughout
# (requests that ended alone, or the lowest load seen): beyond it, the classes' mix decides
# what a class's speed reads (a sampled row keeps a DFlash batch plain), and no advantage is
# read at all. Live, a gateway started at c = 16 read it reversed from such requests and sent
# the classes to each other's pools (run W, loadtest/RESULTS.md; the module's docstring).
ALONE_READ_UP_TO = 4.0
# Beyond every class's evidence on a pool other than its home, a request's speed there falls
# as 1 / load: the pool's tokens/s held at the highest load seen (a burst onto loads never
# seen sends each class home, not wherever its estimate stayed flat).
UNSEEN_SLOPE = 1.0
# An exploring request goes to a pool it expects to run x times slower on (x <= 1) with
# probability x to this power: where the pools are alike, and the choice is in doubt, it explores
# at the full share; where one is far faster, rarely (the module's docstring).
EXPLORATION_PRICE_POWER = 2.0
# The share of recent requests that must have found a busy pool already mixed before the
# lean is waived there: a pool the lean keeps unmixed most of the time is not given up on for
# one sampled request that got in (live, waived at once, sampled requests followed it into
# the DFlash pool at c = 4 and the greedy class ran 0.78x). In the model (a quarter greedy,
# the lean held), the DFlash pool was mixed for 4 % of the requests at c = 4, all at c = 16.
MOSTLY_MIXED = 0.5
# The cost a request brings the rows of another class on the worker it joins (a sampled row
# keeping a DFlash batch's greedy rows plain) counts only where those rows run this much slower
# (log) with another class in flight throughout than with none: below it, the regression's
# noise (about 0.07 at 15 % spread per speed over the last 200 requests) would read a cost
# that is not there, a plain pool's, and keep requests from it.
HARM_FLOOR = 0.1
# A joining request shares on average about half of the remaining life of the rows in flight.
HARM_OVERLAP = 0.5
# Requests, and a spread of the share of their life mixed, before a class's harm is read;
# and how many standard errors HARM_FLOOR must stand from zero for a reading to count.
HARM_MIN_SAMPLES = 20
HARM_MIN_SPREAD = 0.02  # variance of the mixed share
HARM_T = 2.0
# Accepted draft tokens per drafting step a class's requests must average on a pool before
# another class can harm it there: drafting, its rows run at least 1.5x the tokens a step.
HARM_GAIN_FLOOR = 0.5
# The weight of each new request in the harm's moving fit (about the last 200 count): a
# slope needs more evidence than a mean.
HARM_SMOOTHING = 0.01
# Ridge on the log load's variance: where every request ran at about one load, the harm is
# the plain slope on the mixed share, not a division by nothing.
LOAD_RIDGE = 1e-4


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


@dataclass
class Harm:
    """A class's log speed on a pool against the share of its life its worker held a request
    of another class (and its log load): a moving least squares fit whose slope on the mixed
    share is what another class's rows cost it (`harm`). Read at load, unlike the alone
    speeds: under sustained load no request is alone, but the mix on a worker comes and goes."""

    n: int = 0
    # Moving means of m, u, y, mm, uu, mu, my, uy, yy (m the mixed share, u the log load, y
    # the log speed).
    moments: list[float] = field(default_factory=lambda: [0.0] * 9)
    slope: float = 0.0
    # A moving mean of its requests' accepted draft tokens per drafting step, over those that
    # drafted: only a class whose rows gain by drafting can lose it (on a plain pool, or for
    # sampled rows that accept almost nothing, a slope on the mix is a confound: in the
    # model, noise and the drains' low loads read 0.1-0.2 there). Per drafting step, so the
    # mix, which keeps rows from drafting, does not lower it.
    gain: Estimate = field(default_factory=Estimate)

    def add(self, mixed: float, load: float, speed: float, gain: float | None) -> None:
        self.n += 1
        rate = max(HARM_SMOOTHING, 1.0 / self.n)
        if gain is not None:
            self.gain.add(gain, load)
        values = (mixed, load, speed, mixed * mixed, load * load, mixed * load)
        for i, value in enumerate((*values, mixed * speed, load * speed, speed * speed)):
            self.moments[i] += rate * (value - self.moments[i])
        self.fit()

    def fit(self) -> None:
        """The slope on the mixed share, kept as `slope` when known to within HARM_FLOOR /
        HARM_T (one standard error), so that a harm of HARM_FLOOR or more stands HARM_T
        errors from none; else the last such reading stays. A harm that keeps the other
        class away stops its own evidence forming, and must not fade for it."""
        m, u, y, mm, uu, mu, my, uy, yy = self.moments
        var_m, var_u, var_y = mm - m * m, uu - u * u + LOAD_RIDGE, yy - y * y
        cov_mu, cov_my, cov_uy = mu - m * u, my - m * y, uy - u * y
        det = var_m * var_u - cov_mu * cov_mu
        if self.n >= HARM_MIN_SAMPLES and var_m >= HARM_MIN_SPREAD and det > 0:
            slope = (cov_my * var_u - cov_mu * cov_uy) / det
            on_load = (cov_uy * var_m - cov_mu * cov_my) / det
            residual = max(var_y - slope * cov_my - on_load * cov_uy, 0.0)
            samples = min(self.n, 2 / HARM_SMOOTHING)  # a moving mean's effective count
            if math.sqrt(residual * var_u / (det * samples)) <= HARM_FLOOR / HARM_T:
                self.slope = slope

    def harm(self) -> float:
        """How much slower (log) a row of this class runs with another class in flight
        throughout than with none, at the same load (the fit's slope); 0 below HARM_FLOOR,
        without a precise enough reading, or where the class gains little by drafting."""
        drafts = self.gain.n > 0 and self.gain.mean >= HARM_GAIN_FLOOR
        return -self.slope if drafts and -self.slope >= HARM_FLOOR else 0.0


@dataclass(frozen=True)
class PoolLoad:
    """A pool's routable workers and its requests in flight on them; per worker, those
    requests by class."""

    workers: int
    in_flight: int
    classes: tuple[Mapping[str, int], ...] = ()

    def per_worker(self, extra: int = 0) -> float:
        return (self.in_flight + extra) / max(self.workers, 1)

    @property
    def idle(self) -> bool:
        """Some worker has nothing in flight (least outstanding then picks it)."""
        return self.in_flight < self.workers


@dataclass
class SpeedMap:
    exploration: float = 0.05
    home_bias: float = 1.0
    draw: Callable[[], float] = random.random
    estimates: dict[tuple[str, str, int], Estimate] = field(default_factory=dict)
    # Per (pool, class): the requests that ended alone on their worker, whatever they shared
    # before; the alone speed of a gateway that has seen few requests alone throughout.
    ended_alone: dict[tuple[str, str], Estimate] = field(default_factory=dict)
    classes: set[str] = field(default_factory=set)
    # Per pool, the share of the recent requests routed by the rule that found every worker of
    # it busy and it already mixed (a moving average, SMOOTHING a request): how often the lean
    # failed to keep it unmixed.
    mixed_share: dict[str, float] = field(default_factory=dict)
    # Per (pool, class): its speed against the share of its life mixed with another class.
    harms: dict[tuple[str, str], Harm] = field(default_factory=dict)

    def observe(
        self,
        pool: str,
        klass: str,
        load: float,
        speed: float,
        ended_alone: bool = False,
        mixed: float | None = None,
        gain: float | None = None,
    ) -> None:
        """One request's decode speed (tokens/s), which ran at `load` requests in flight on
        its worker, a mean over its lifetime (itself included); `ended_alone`: none other
        was in flight there as it ended; `mixed`: the share of its life a request of another
        class was in flight there; `gain`: its accepted draft tokens per drafting step, where
        it drafted and its worker reports them."""
        if speed > 0 and math.isfinite(speed) and load > 0:
            key = (pool, klass, load_level(load))
            self.estimates.setdefault(key, Estimate()).add(math.log(speed), math.log(load))
            if mixed is not None:
                self.harms.setdefault((pool, klass), Harm()).add(
                    mixed, math.log(load), math.log(speed), gain
                )
            if ended_alone and load <= ALONE_READ_UP_TO:
                self.ended_alone.setdefault((pool, klass), Estimate()).add(
                    math.log(speed), math.log(load)
                )
            self.classes.add(klass)

    def alone(self, pool: str, klass: str) -> float | None:
        """`klass`'s log tokens/s alone on a worker of `pool`, which the advantage is read
        from: from the requests alone there throughout; without enough of them, from those
        that ended alone. A gateway started under load sees few requests alone throughout, and
        read at the lowest load it saw instead, the classes' mix hid the advantage: live, at
        c = 4 from a cold start, the two classes swapped pools (0.76x the best static split).
        Ended alone, a greedy request may have shared the DFlash batch with a sampled one for
        a while, slowed, but such requests are many. Else the lowest load's. Neither counts
        beyond ALONE_READ_UP_TO in flight on average: None then (no advantage is read)."""
        throughout = self.estimates.get((pool, klass, load_level(ALONE)))
        for found in (throughout, self.ended_alone.get((pool, klass))):
            if found is not None and found.n >= MIN_SAMPLES:
                return found.mean
        points = self.evidence(pool, klass)
        if points and points[0].load <= math.log(ALONE_READ_UP_TO) + 1e-9:
            return points[0].mean
        return None

    def evidence(self, pool: str, klass: str) -> list[Estimate]:
        """`klass`'s estimates on `pool` with enough samples to use, by load level."""
        found = (self.estimates.get((pool, klass, level)) for level in range(len(LEVELS) + 1))
        return [e for e in found if e is not None and e.n >= MIN_SAMPLES]

    def log_speed(
        self, pool: str, klass: str, load: float, unseen_slope: float = 0.0
    ) -> float | None:
        """Expected log tokens/s at `load` in flight per worker: interpolated between the
        levels with evidence; beyond the highest, its speed there less the decline the
        pool's other classes show from that load to this one (none with evidence this far:
        less `unseen_slope` times the log of the load's growth); below the lowest, that
        one's; None without any."""
        points = self.evidence(pool, klass)
        if not points:
            return None
        at = math.log(max(load, 1e-9))
        top = points[-1].load
        own = along(points, at)
        if at <= top:
            return own
        # A class the lean keeps off a pool is seen there only at low load; read flat, it
        # would look as fast there at any load, and leave its home for a crowded batch.
        declines = []
        for other in sorted(self.classes - {klass}):
            theirs = self.evidence(pool, other)
            if theirs and theirs[-1].load >= at:
                declines.append(along(theirs, at) - along(theirs, top))
        if declines:
            return own + min(0.0, sum(declines) / len(declines))
        return own - unseen_slope * (at - top)

    def class_edges(self, pools: Collection[str]) -> dict[str, dict[str, float]]:
        """Per class with evidence alone on every pool, and per pool: how much faster (log)
        it runs alone there than the mean of those classes; none without two such classes."""
        alone = {j: [self.alone(pool, j) for pool in pools] for j in sorted(self.classes)}
        known = {j: [s or 0.0 for s in speeds] for j, speeds in alone.items() if None not in speeds}
        if len(known) < 2:
            return {}
        means = [
            sum(speeds[i] for speeds in known.values()) / len(known) for i in range(len(pools))
        ]
        return {
            j: {pool: speeds[i] - means[i] for i, pool in enumerate(pools)}
            for j, speeds in known.items()
        }

    def advantages(self, pools: Collection[str]) -> dict[str, dict[str, float]]:
        """Per class and pool, its comparative advantage there (log, the module's docstring):
        its class edge less that edge's mean over the pools; none for a class without one."""
        out = {}
        for klass, edge in self.class_edges(pools).items():
            mean = sum(edge.values()) / len(edge)
            out[klass] = {pool: value - mean for pool, value in edge.items()}
        return out

    def advantage(self, klass: str, pools: Collection[str]) -> dict[str, float]:
        """`klass`'s comparative advantage per pool (advantages); zeros without one."""
        return self.advantages(pools).get(klass) or dict.fromkeys(pools, 0.0)

    def harm(self, pool: str, klass: str) -> float:
        """How much slower (log) `klass` runs on `pool` with another class in flight on its
        worker throughout than with none (Harm)."""
        found = self.harms.get((pool, klass))
        return found.harm() if found is not None else 0.0

    def harm_brought(self, klass: str, pool: str, load: PoolLoad) -> float:
        """What a request of `klass` costs the rows on the worker of `pool` it would join (the
        least busy): each row of another class that other classes harm there (`harm`), for
        about HARM_OVERLAP of its life, over 1 + the rows already there that harm it (a row
        joining a batch already mixed extends the mix only by the time it outlives them: on
        average 1 / (1 + s) of a life). Nothing on an idle worker. Asymmetric, as the engine
        is: a sampled row keeps a DFlash batch's greedy rows plain; a greedy row costs a batch
        of sampled ones nothing."""
        if not load.classes:
            return 0.0
        fewest = min(sum(held.values()) for held in load.classes)
        costs = []
        for held in load.classes:
            if sum(held.values()) == fewest:
                rows = sum(held.values())
                cost = sum(
                    n * self.harm(pool, j) / (1 + rows - n)
                    for j, n in held.items()
                    if j != klass and n > 0
                )
                costs.append(HARM_OVERLAP * cost / (rows + 1))
        return min(costs)

    def mostly_mixed(
        self, loads: Mapping[str, PoolLoad], advantages: Mapping[str, Mapping[str, float]]
    ) -> dict[str, bool]:
        """Per pool: already mixed now (already_mixed), and for at least MOSTLY_MIXED of the
        recent requests that found every worker of it busy (an idle worker is neither mixed
        nor kept unmixed: a burst's first requests, onto idle pools, do not count)."""
        out = {}
        for pool, load in loads.items():
            now = already_mixed(pool, load, advantages)
            share = self.mixed_share.get(pool, 0.0)
            if load.classes and all(load.classes):
                share = self.mixed_share[pool] = share + SMOOTHING * (float(now) - share)
            out[pool] = now and share >= MOSTLY_MIXED
        return out

    def choose(
        self, klass: str, loads: Mapping[str, PoolLoad], weights: Mapping[str, float]
    ) -> str:
        """The pool for a request of `klass`: by weights while some pool has no estimate for
        it, or exploring onto an idle worker, or, with none idle, onto a pool no busier than
        the rule's pick and not away from its home (onto a slower one at its price); else by
        the score (the module's docstring)."""
        drawn = drawn_by_weight(weights, self.draw) if self.draw() < self.exploration else None
        explore = drawn if drawn is not None and loads[drawn].idle else None
        if not all(self.evidence(pool, klass) for pool in loads):
            if explore is not None:
                log.debug("%s to %s: exploring onto an idle worker", klass, explore)
                return explore
            drawn = drawn_by_weight(weights, self.draw)
            log.debug("%s to %s: by weights, no estimate on every pool yet", klass, drawn)
            return drawn
        every = self.advantages(list(loads))
        edge = every.get(klass) or dict.fromkeys(loads, 0.0)
        home = max(edge.values())
        # The lean spares the other pools' home classes a request away from its home. Where
        # each of those pools already holds one on every worker, and did for MOSTLY_MIXED of
        # the recent requests that found it busy (the lean cannot keep it unmixed anyway),
        # another costs them nothing: no lean.
        away = [pool for pool in loads if edge[pool] < home]
        mixed = self.mostly_mixed(loads, every)
        waived = bool(away) and all(mixed[pool] for pool in away)
        lean = 0.0 if waived else self.home_bias
        # Where no class has been seen at such a load, away from home: a pool's tokens/s
        # held (UNSEEN_SLOPE); at home, as fast as at the highest load seen. In doubt, home.
        own = {
            pool: self.log_speed(
                pool, klass, load.per_worker(1), 0.0 if edge[pool] >= home else UNSEEN_SLOPE
            )
            for pool, load in loads.items()
        }
        brought = {pool: self.harm_brought(klass, pool, load) for pool, load in loads.items()}
        score = {
            pool: (own[pool] or 0.0) + lean * max(edge[pool], 0.0) - brought[pool] for pool in own
        }
        chosen = max(sorted(score), key=lambda pool: score[pool])
        onto = "an idle worker"
        # No worker idle (sustained load): onto a pool no busier than the rule's pick, and not
        # away from its home (any pool, with no advantage read). Else the estimates formed in
        # a gateway's first crowd are never refreshed (the module's docstring).
        if (
            explore is None
            and drawn is not None
            and edge[drawn] >= home
            and not brought[drawn]
            and loads[drawn].per_worker() <= loads[chosen].per_worker()
        ):
            explore, onto = drawn, "a pool no busier than its pick"
        if explore is not None and explore != chosen:
            # Onto a pool it expects to run slower on, at (that speed / the chosen pool's) to
            # the EXPLORATION_PRICE_POWER: in doubt (pools alike) at the full share.
            slower = min((own[explore] or 0.0) - (own[chosen] or 0.0), 0.0)
            if self.draw() < math.exp(EXPLORATION_PRICE_POWER * slower):
                log.debug("%s to %s: exploring onto %s", klass, explore, onto)
                return explore
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s to %s%s: %s",
                klass,
                chosen,
                " (no lean: every pool away from home mixed)" if waived else "",
                ", ".join(
                    f"{pool} at {loads[pool].per_worker(1):g} in flight: "
                    f"{math.exp(own[pool] or 0.0):.0f} tokens/s, advantage {edge[pool]:+.3f}"
                    + (f", harm brought {brought[pool]:.3f}" if brought[pool] else "")
                    for pool in sorted(score)
                ),
            )
        return chosen


def already_mixed(pool: str, load: PoolLoad, advantages: Mapping[str, Mapping[str, float]]) -> bool:
    """Every worker of `pool` holds a request of a class away from its home there (a pool
    where its comparative advantage is below its best): the cost such a request brings its
    home class (a DFlash batch kept plain for a sampled row) is already paid."""

    def away(klass: str) -> bool:
        found = advantages.get(klass)
        return found is not None and found[pool] < max(found.values())

    return bool(load.classes) and all(any(map(away, held)) for held in load.classes)


def along(points: list[Estimate], at: float) -> float:
    """The log speed at log load `at` along `points` (by load): interpolated between them,
    the nearest one's beyond them."""
    below: Estimate | None = None
    for found in points:
        if found.load >= at:
            if below is None or found.load - below.load < 1e-9:
                return found.mean
            share = (at - below.load) / (found.load - below.load)
            return below.mean + share * (found.mean - below.mean)
        below = found
    return points[-1].mean


def speed_map(settings: GatewaySettings) -> SpeedMap | None:
    """The fleet's speed map under ROUTING=fastest; None under any other routing."""
    if settings.routing != "fastest":
        return None
    return SpeedMap(settings.fastest_exploration, settings.fastest_home_bias)


class Loaded(Protocol):
    """What a pool's load reads of a worker (service/routing/fleet.py's Worker)."""

    pool: str
    outstanding: int
    in_flight_by_class: dict[str, int]


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


def fastest_pool(
    speeds: SpeedMap, klass: str, workers: Sequence[Loaded], weights: Mapping[str, float]
) -> str:
    """The pool of `workers` for a request of `klass` (SpeedMap.choose). A pool at weight 0
    (an operator's pin, or a canary rolled back) is not offered while a weighted one is: a
    drain holds under `fastest` too. The positive weights steer its exploring share."""
    offered = effective_weights(weights)
    if len(offered) == 1:
        return next(iter(offered))
    eligible = [w for w in workers if w.pool in offered]
    return speeds.choose(klass, pool_loads(eligible), offered)


def pool_loads(workers: Iterable[Loaded]) -> dict[str, PoolLoad]:
    """Each pool's workers, requests in flight on them, and per worker their classes."""
    count: dict[str, int] = {}
    in_flight: dict[str, int] = {}
    classes: dict[str, list[Mapping[str, int]]] = {}
    for worker in workers:
        count[worker.pool] = count.get(worker.pool, 0) + 1
        in_flight[worker.pool] = in_flight.get(worker.pool, 0) + worker.outstanding
        classes.setdefault(worker.pool, []).append(dict(worker.in_flight_by_class))
    return {pool: PoolLoad(count[pool], in_flight[pool], tuple(classes[pool])) for pool in count}
