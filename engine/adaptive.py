"""Adaptive speculation: how many draft tokens to verify in the next step. No torch.

Three small parts:
- `CostModel`: seconds of one step verifying `k` drafts (width k + 1) for `b` rows,
  measured at start-up on a grid by `calibrate(measure, ...)` and interpolated between
  grid points (linear in b and in the width; extrapolated linearly beyond the grid).
- `AcceptanceStats`: live per-position acceptance. Position j (1-based) is *tried* in a
  row-step that verified k >= j drafts and accepted the first j - 1; it is *accepted*
  when the first j were. Counts decay exponentially with drafting steps (recent traffic
  weighs most; plain steps tell nothing and age nothing, unless the owner fades them: one
  request's own estimates, row_speculation.py) and start from an optimistic
  prior, so unexplored positions look worth trying. Each later position's prior is the
  estimate of the one before it: a row whose first draft is seldom accepted has little
  evidence about its deeper ones, and they are not assumed better than its first.
- `SpecPolicy.choose(batch_size, stats, pending)`: the k in [0, max_k] maximising expected
  tokens per second, b * E[tokens per row | k] / cost(b, k), where
  E[tokens | k] = 1 + sum_{j<=k} prod_{i<=j} a_i (a_i = acceptance of position i given
  the ones before). k = 0 is plain decoding, and wins unless drafting beats it by
  `margin` (3%). A drafting step after plain ones first catches up the drafter context
  they put off (`pending` positions, at the calibrated cost per position, spread over
  `catch_up_horizon` steps). Every `explore_every` steps it verifies a few more drafts
  than the optimum so the estimates of the next positions stay fresh; from plain, only
  when the catch-up is cheap, and at doubling intervals while the looks find nothing.
  A busy server that went plain therefore stays plain until its batch shrinks (the
  frozen estimates then decide), not until a look proves drafting pays again.

`speculative_tokens_per_batch_size` derives vLLM's static batch-size -> k table from the
same model: for each batch size, the k `choose` would pick at the given acceptance rates.
For the production (GPU) worker the costs must be the server's own: step latency per
(batch size, k) measured against the vLLM server (CostModel.from_json), and the rates
from its acceptance counters (vllm:spec_decode_num_accepted_tokens_per_pos over
vllm:spec_decode_num_drafts, made conditional: a_j = accepted_j / accepted_{j-1}).
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

Measure = Callable[[int, int], float]  # (batch size, num drafts k) -> seconds per step


@dataclass(frozen=True)
class ContextTerm:
    """How a step's cost moves with its rows' context away from the grid's: every row
    reads the keys up to the batch's longest context (whatever k), every verified query
    attends to them, and a drafting step's drafter attends to its own context with its
    whole block, however many drafts are verified. Zero slopes: the grid's context is
    assumed throughout."""

    tokens: int = 0  # the context the grid was measured at
    per_row_key: float = 0.0  # seconds per row per key position
    per_query_key: float = 0.0  # seconds per verified query (k + 1 per row) per key
    per_drafting_key: float = 0.0  # seconds per drafting row per key (the drafter's block)

    def extra(self, batch_size: int, k: int, context: int) -> float:
        return batch_size * self.per_key(k) * (context - self.tokens)

    def per_key(self, k: int) -> float:
        """Seconds per row per key position of a step verifying k drafts."""
        per_key = self.per_row_key + (k + 1) * self.per_query_key
        if k:
            per_key += self.per_drafting_key
        return per_key

    @property
    def moves(self) -> bool:
        """Whether the cost moves with the context at all."""
        return bool(self.per_row_key or self.per_query_key)

    @classmethod
    def fit(
        cls, short: int, long: int, batch_size: int, k: int, plain: tuple[float, float],
        one: tuple[float, float], drafting: tuple[float, float],
    ) -> ContextTerm:  # fmt: skip
        """From one batch size's step seconds at a short and a long context ((short, long)
        pairs): plain, verifying one draft, and verifying k > 1 drafts. The slopes come
        from the growths: k drafts over one draft gives the per-query slope, plain the
        per-row one, one draft over plain the drafter's. Noise never makes one negative."""
        span = batch_size * (long - short)
        grow = [max(0.0, pair[1] - pair[0]) / span for pair in (plain, one, drafting)]
        per_query = max(0.0, (grow[2] - grow[1]) / (k - 1)) if k > 1 else 0.0
        per_row = max(0.0, grow[0] - per_query)
        per_drafting = max(0.0, grow[1] - grow[0] - per_query)
        return cls(short, per_row, per_query, per_drafting)


@dataclass(frozen=True)
class CostModel:
    """Step seconds on a grid of batch sizes x draft counts (k = 0 is plain decoding),
    measured at one context, and how they move with the context."""

    batch_sizes: tuple[int, ...]
    num_drafts: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]  # [batch index][k index]
    # Seconds per position of drafter context put off by plain steps and projected in one
    # batched pass when speculation resumes (speculative.catch_up); 0 = not measured.
    catch_up_per_position: float = 0.0
    context: ContextTerm = ContextTerm()

    def __post_init__(self) -> None:
        if not self.batch_sizes or not self.num_drafts:
            raise ValueError("a cost model needs at least one batch size and one k")
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)) or list(
            self.num_drafts
        ) != sorted(set(self.num_drafts)):
            raise ValueError("batch sizes and draft counts must be increasing")
        if len(self.seconds) != len(self.batch_sizes) or any(
            len(row) != len(self.num_drafts) for row in self.seconds
        ):
            raise ValueError("seconds must be [batch sizes][draft counts]")
        if any(s <= 0 for row in self.seconds for s in row):
            raise ValueError("step costs must be positive")
        if self.catch_up_per_position < 0:
            raise ValueError("the catch-up cost cannot be negative")

    def cost(self, batch_size: int, k: int) -> float:
        """Seconds of one step verifying k drafts for batch_size rows (interpolated)."""
        return self.curve(batch_size, k)[k]

    def curve(self, batch_size: int, max_k: int, context: int | None = None) -> list[float]:
        """cost(batch_size, k) for k = 0..max_k, interpolating over the batch once; at
        the grid's context, or at `context` (the longest of the step's rows)."""
        at_b = [
            _interpolate(self.batch_sizes, [row[j] for row in self.seconds], batch_size)
            for j in range(len(self.num_drafts))
        ]
        base = [max(1e-9, _interpolate(self.num_drafts, at_b, k)) for k in range(max_k + 1)]
        return base if context is None else self.at_context(base, batch_size, context)

    def at_context(
        self,
        base: list[float],
        batch_size: int,
        context: int,
        slopes: Sequence[float] | None = None,
    ) -> list[float]:
        """A grid curve moved to `context` (never below a quarter of the grid's cost);
        `slopes`: the context term's `per_key` at each k from 0 (computed when None)."""
        term = self.context
        if not term.moves:
            return base
        span = context - term.tokens
        slopes = slopes or [term.per_key(k) for k in range(len(base))]
        return [_moved(c, batch_size * s, span) for c, s in zip(base, slopes, strict=False)]

    def relative(self, batch_size: int, k: int) -> float:
        """The cost in plain steps at the same batch size."""
        return self.cost(batch_size, k) / self.cost(batch_size, 0)

    def monotone(self) -> CostModel:
        """The same grid with every cost raised to the running maximum along k and along
        the batch size: a wider or bigger step never costs less. Removes the inversions
        a noisy machine leaves in single measurements."""
        rows = [list(_running_max(row)) for row in self.seconds]
        for j in range(len(self.num_drafts)):
            column = list(_running_max([row[j] for row in rows]))
            for i, value in enumerate(column):
                rows[i][j] = value
        grid = tuple(tuple(r) for r in rows)
        return replace(self, seconds=grid)

    def to_json(self) -> dict[str, object]:
        return {
            "batch_sizes": list(self.batch_sizes),
            "num_drafts": list(self.num_drafts),
            "seconds": [list(row) for row in self.seconds],
            "catch_up_per_position": self.catch_up_per_position,
            "context": asdict(self.context),
        }

    @classmethod
    def from_json(cls, raw: dict[str, object]) -> CostModel:
        """Inverse of to_json (e.g. step latencies measured on a vLLM server)."""
        try:
            bs = tuple(int(b) for b in raw["batch_sizes"])  # type: ignore[attr-defined]
            ks = tuple(int(k) for k in raw["num_drafts"])  # type: ignore[attr-defined]
            rows = raw["seconds"]
            seconds = tuple(tuple(float(x) for x in row) for row in rows)  # type: ignore[attr-defined]
            catch_up = float(raw.get("catch_up_per_position", 0.0))  # type: ignore[arg-type]
            context = ContextTerm(**raw.get("context", {}))  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a cost model: {exc}") from exc
        return cls(bs, ks, seconds, catch_up, context)


def _moved(cost: float, growth: float, span: int) -> float:
    """A grid cost moved `span` tokens of context at `growth` seconds per token, never
    below a quarter of it (a longer context only adds: the floor cannot bind)."""
    moved = cost + growth * span
    return moved if span >= 0 else max(cost / 4, moved)


def _running_max(values: Iterable[float]) -> Iterable[float]:
    top = 0.0
    for v in values:
        top = max(top, v)
        yield top


def _interpolate(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys); linear extrapolation from the end segments."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def calibrate(
    measure: Measure,
    batch_sizes: Iterable[int],
    num_drafts: Iterable[int],
    passes: int = 1,
    catch_up_per_position: float = 0.0,
) -> CostModel:
    """Measure the grid `passes` times, a whole pass at a time (so a burst of load on a
    shared machine spoils one value per cell, not one cell), take each cell's minimum
    (other processes only ever add time), then make the grid monotone."""
    bs, ks = tuple(sorted(set(batch_sizes))), tuple(sorted(set(num_drafts)))
    samples: dict[tuple[int, int], list[float]] = {(b, k): [] for b in bs for k in ks}
    for _ in range(max(1, passes)):
        for b in bs:
            for k in ks:
                samples[(b, k)].append(measure(b, k))
    seconds = tuple(tuple(min(samples[(b, k)]) for k in ks) for b in bs)
    return CostModel(bs, ks, seconds, catch_up_per_position).monotone()


def default_grid(max_num_seqs: int, max_k: int) -> tuple[list[int], list[int]]:
    """Calibration points: batch sizes 1, 2, 4, ... up to max_num_seqs (included) and
    draft counts 0, 1, 2, 3, 5, 7, 11, 15, ... up to max_k (included)."""
    bs = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < max_num_seqs} | {max_num_seqs})
    ks = sorted({k for k in (0, 1, 2, 3, 5, 7, 11, 15, 23, 31) if k < max_k} | {max_k})
    return bs, ks


@dataclass
class AcceptanceStats:
    """Per-position acceptance with exponential forgetting (see the module docstring)."""

    max_k: int
    halflife_steps: float = 32.0  # steps after which old observations weigh half
    prior_rate: float = 0.8  # optimistic: positions never tried look worth trying
    prior_weight: float = 2.0  # pseudo-trials behind the prior
    # Per-position priors instead (e.g. the acceptance of requests like this one), each
    # behind `prior_weight` pseudo-trials and capped by the estimate of the position
    # before; empty: `prior_rate`, chained as below.
    prior_rates: tuple[float, ...] = ()
    tried: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    idle: int = 0  # plain steps not yet faded into the counts (fade())
    drafted_steps: int = 0  # observations with a draft in them (fading leaves it be)
    _rates: list[float] | None = field(default=None, repr=False)  # until the next observe
    # optimistic_rates(z) per z asked, until the next observe: the planner asks for every
    # row at every step it weighs, and a row's estimates move only when it drafts. Per z, not
    # the last one: z is OPTIMISM over the batch size, which a busy batch's arrivals and
    # departures move between two values from step to step, and a look asks at OPTIMISM too
    # (one slot recomputed a row's rates at most re-plans of a 32-row churning batch).
    _optimistic: dict[float, list[float]] = field(default_factory=dict, repr=False)
    # tokens_by_k per (doubt, reach), until the next observe or fade: read for every row
    # at every step the planner weighs (15 products each, 32 rows)
    _curves: dict[tuple[float, int], list[float]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.tried:
            self.tried = [0.0] * self.max_k
            self.accepted = [0.0] * self.max_k

    def observe(self, rows: Iterable[tuple[int, int]]) -> None:
        """One step's results: (num_drafted, num_accepted) per row. A step that drafted
        nothing is no observation: forgetting goes by drafting steps, so estimates made
        before a stretch of plain steps are still there when speculation is weighed again."""
        rows = list(rows)
        if not any(num_drafted for num_drafted, _ in rows):
            return
        self._settle()
        self.idle = 0
        self.drafted_steps += 1
        keep = 0.5 ** (1.0 / self.halflife_steps)
        self._forget_estimates()
        self.tried = [t * keep for t in self.tried]
        self.accepted = [a * keep for a in self.accepted]
        for num_drafted, num_accepted in rows:
            for j in range(min(num_accepted + 1, num_drafted, self.max_k)):
                self.tried[j] += 1.0
                if j < num_accepted:
                    self.accepted[j] += 1.0

    def fade(self, steps: int = 1) -> None:
        """A step on which this request did not draft. A request's own evidence fades by
        such steps toward its prior, at the rate of drafting ones: its acceptance moves
        within an answer (a short prompt's first tokens are guessed worse than what
        follows), so two rejections early on must not keep it plain to the end. Applied
        `FADE_CHUNK` steps at a time (the planner reads the estimates of every row it
        weighs). `steps`: that many such steps at once."""
        before = self.idle
        self.idle += steps
        if self.idle // FADE_CHUNK > before // FADE_CHUNK and any(self.tried):
            self._forget_estimates()  # a chunk completed (no evidence: nothing fades)

    def _forget_estimates(self) -> None:
        """The kept estimates are stale: the counts moved (or will at the next read)."""
        self._rates = None
        self._optimistic.clear()
        self._curves.clear()

    def _settle(self) -> None:
        """The fade of the whole chunks of idle steps, into the counts."""
        steps = self.idle - self.idle % FADE_CHUNK
        if steps:
            keep = 0.5 ** (steps / self.halflife_steps)
            self.tried = [t * keep for t in self.tried]
            self.accepted = [a * keep for a in self.accepted]
            self.idle -= steps

    def rates(self) -> list[float]:
        """a_j: acceptance of position j + 1 given every earlier one was accepted."""
        if self._rates is None:
            self._rates = self._estimate()
        return self._rates

    def _estimate(self) -> list[float]:
        self._settle()
        w, prior = self.prior_weight, self.prior_rate
        rates = []
        for j, (a, t) in enumerate(zip(self.accepted, self.tried, strict=True)):
            if self.prior_rates:
                prior = min(prior, self.prior_rates[j]) if j else self.prior_rates[0]
            rate = (a + w * prior) / (t + w)
            rates.append(rate)
            prior = rate  # a position seldom reached is not judged better than the one before
        return rates

    def optimistic_rates(self, z: float) -> list[float]:
        """`rates()` raised by z standard errors of each estimate (its own trials and the
        prior's pseudo-trials): what the evidence does not yet rule out. A request planned
        from point estimates that two early rejections put just under break-even drafts no
        more and so never learns otherwise; with the bonus it drafts until its own trials
        have shrunk the doubt, and only then stays plain."""
        found = self._optimistic.get(z)
        if found is not None:
            return found
        w, point = self.prior_weight, self.rates()  # settled: self.tried is current
        rates = self._optimistic[z] = [
            min(1.0, r + z * math.sqrt(r * (1.0 - r) / (t + w)))
            for r, t in zip(point, self.tried, strict=True)
        ]
        return rates

    def expected_tokens(self, k: int) -> float:
        """E[tokens committed per row] when verifying k drafts (bonus token included)."""
        return expected_tokens(self.rates(), k)

    def tokens_by_k(self, z: float = 0.0, tokens_left: int = 0) -> list[float]:
        """`cumulative_tokens` of `optimistic_rates(z)` (z = 0: of `rates()`) for a
        request with `tokens_left` to go, kept until the estimates move."""
        key = (z, _reach(self.max_k, tokens_left))
        curve = self._curves.get(key)
        if curve is None:
            rates = self.optimistic_rates(z) if z else self.rates()
            curve = self._curves[key] = cumulative_tokens(rates, self.max_k, tokens_left)
        return curve


# Plain steps faded into a request's own counts at a time (AcceptanceStats.fade).
FADE_CHUNK = 4


def expected_tokens(rates: Sequence[float], k: int) -> float:
    total, survive = 1.0, 1.0
    for a in rates[:k]:
        survive *= a
        total += survive
    return total


def cumulative_tokens(rates: Sequence[float], max_k: int, tokens_left: int = 0) -> list[float]:
    """E[tokens | k] for k = 0..max_k (bonus token included), in one pass. A row with
    `tokens_left` to go (0: not known) commits at most that many: drafts past its end are
    verified for nothing, so they add nothing (short answers end in a wide block's middle)."""
    reach = _reach(max_k, tokens_left)
    out, total, survive = [1.0], 1.0, 1.0
    for a in rates[:reach]:
        survive *= a
        total += survive
        out.append(total)
    return out + [total] * (max_k - reach)


def _reach(max_k: int, tokens_left: int) -> int:
    """The most drafts that can still commit: all but the bonus of the tokens left."""
    return max_k if tokens_left <= 0 else min(max_k, tokens_left - 1)


# The most catch-up (in plain steps at the same batch size) an exploring step may pay.
EXPLORE_CATCH_UP = 0.25
# Explorations from k = 0 that leave k = 0 the best double the interval to the next one,
# up to this many times `explore_every` (drafts that are never accepted then cost little).
EXPLORE_BACKOFF = 8


# The most one step's log(observed / modelled) seconds moves a feedback average by, times
# its weight: a step more than twice as slow (or fast) as the average counts as twice.
MAX_STEP_RATIO = math.log(2.0)


def _toward(average: float, ratio: float, weight: float) -> float:
    """A moving average's next value: `weight` of the way to `ratio`, the step bounded by
    MAX_STEP_RATIO (a robust mean: an error the steps share is learnt in full, at most
    weight * MAX_STEP_RATIO a step; one outlier moves it by no more than that)."""
    return average + weight * min(max(ratio - average, -MAX_STEP_RATIO), MAX_STEP_RATIO)


@dataclass
class CostFeedback:
    """Observed over modelled step seconds at one grid batch size, as robust moving averages
    of the log ratio (`observe`): `overall` over every k, and per grid k its deviation from
    the overall of its own steps' time."""

    overall: float | None = None
    per_k: dict[int, float] = field(default_factory=dict)  # log deviation from `overall`
    _per_k: list[float] | None = None  # at_each_k() until the next observation

    def observe(self, grid_k: int, ratio: float, weight: float) -> None:
        """One step's log(observed / modelled) seconds. Every average moves `_toward` each
        ratio from where the model puts it: one slow step (a stall, another process) must
        not price its k out of later plans, since a k priced out is not run again to
        correct it. Started from its first ratio, a k's factor was whatever its first step
        met: in a replay of the planner on recorded acceptance, with the first step of
        each k at 3x, adaptive read 0.68x the best fixed k at the median, and in the worst
        cases never drafted again (loadtest/RESULTS.md).

        A k's deviation is taken from the overall as it stood at its step (the mean of the
        overall before and after it, which leaves no bias when ks alternate): the whole
        machine's speed moves (a neighbour, the clock, a calibration off by a factor) while
        some k does not run, and an average of the k's own ratios, not relative to the
        overall of their time, kept that move as the k's own error. Replayed on recorded
        acceptance with a calibration 25 % slower than the machine, a draft count seen a
        few times early was then priced 1.25x the rest, the monotone curve priced every
        count up to 11 as high, and adaptive read 0.98-0.99x the best fixed k at one row
        (1.03-1.05x with the calibration at the machine's speed, and either way with the
        deviations kept relative)."""
        self._per_k = None
        before = self.overall or 0.0
        self.overall = _toward(before, ratio, weight)
        then = (before + self.overall) / 2
        self.per_k[grid_k] = _toward(self.per_k.get(grid_k, 0.0), ratio - then, weight)

    def factors(self) -> dict[int, float]:
        """Per grid k: how much dearer than the model it ran, relative to all k."""
        if self.overall is None:
            return {}
        return {g: math.exp(v) for g, v in self.per_k.items()}

    def at_each_k(self, nearest: Sequence[int]) -> list[float] | None:
        """factors() at each k = 0..len(nearest)-1 through its nearest grid k (None: no
        correction yet), kept until the next observation: a planned step reads it ~2n
        times. `nearest` is its policy's, the same at every call (one feedback per policy
        and grid batch size)."""
        if self.overall is None:
            return None
        if self._per_k is None:
            factor = self.factors()
            self._per_k = [factor.get(g, 1.0) for g in nearest]
        return self._per_k


@dataclass
class SpecPolicy:
    """Picks k per step; `mode="fixed"` always verifies max_k (the old behaviour).

    `observe_cost` (optional) feeds back measured step times: at each grid batch size, the
    calibrated cost of each grid k is corrected by how its observed times compare with the
    model, relative to all observations at that batch size (a uniform slowdown of the
    machine changes no decision; a calibration that was off at some cell, e.g. because live
    contexts are longer than the calibration's, is repaired once that cell has run).

    Drafting is chosen only when the model expects more than `margin` over plain decoding's
    tokens/s: near break-even (a busy server) the model's error of a few percent would
    otherwise decide, and plain decoding is the side that cannot lose.

    `choose` runs every engine step, so the model's curve per batch size is computed once
    and kept; only the feedback factors (one per grid k) change from step to step."""

    costs: CostModel
    max_k: int
    mode: Literal["adaptive", "fixed"] = "adaptive"
    explore_every: int = 16  # steps; 0 = never explore
    # Drafting steps over which the catch-up of context put off by plain steps is spread
    # when weighing whether to draft again (the caught-up context serves them all).
    catch_up_horizon: int = 16
    feedback_weight: float = 0.1  # EWMA weight of one observed step time
    margin: float = 0.03
    _steps: int = 0  # since the last exploration
    _interval: int = 0  # steps between explorations (explore_every, backed off)
    _feedback: dict[int, CostFeedback] = field(default_factory=dict)  # per grid batch size
    _base: dict[int, list[float]] = field(default_factory=dict)  # model curve per batch size
    _nearest: list[int] = field(default_factory=list)  # nearest grid k of each k
    _grid_batch: dict[int, int] = field(default_factory=dict)  # nearest grid batch size
    _context_slopes: tuple[float, ...] = ()

    def cost(self, batch_size: int, k: int) -> float:
        """Model seconds with the feedback correction (relative, per nearest grid cell)."""
        return self.curve(batch_size)[k]

    def _feedback_at(self, batch_size: int) -> CostFeedback:
        grid = self._grid_batch.get(batch_size)
        if grid is None:
            grid = min(self.costs.batch_sizes, key=lambda b: (abs(b - batch_size), b))
            self._grid_batch[batch_size] = grid
        feedback = self._feedback.get(grid)
        if feedback is None:
            feedback = self._feedback[grid] = CostFeedback()
        return feedback

    def _model_curve(self, batch_size: int) -> list[float]:
        base = self._base.get(batch_size)
        if base is None:
            base = self._base[batch_size] = self.costs.curve(batch_size, self.max_k)
        return base

    def curve(self, batch_size: int, context: int | None = None) -> list[float]:
        """cost(batch_size, k) for k = 0..max_k at `context` (None: the grid's), feedback
        included."""
        base = self._model_curve(batch_size)
        if context is not None:
            base = self.costs.at_context(base, batch_size, context, self._slopes())
        factors = self._feedback_at(batch_size).at_each_k(self._nearest_grid())
        corrected = base if factors is None else list(map(operator.mul, base, factors))
        # Corrected per grid k or moved to a short context, a wider step must still never
        # look cheaper than a narrower (so no k costs less than plain_cost).
        if all(map(operator.le, corrected, corrected[1:])):
            return corrected
        return list(itertools.accumulate(corrected, max))

    def plain_cost(self, batch_size: int, context: int | None = None) -> float:
        """curve(batch_size, context)[0] without the rest of the curve."""
        return self.plain_costs((batch_size,), (context,))[0]

    def plain_costs(
        self, batch_sizes: Iterable[int], contexts: Iterable[int | None]
    ) -> list[float]:
        """plain_cost of each (batch size, context) pair: the planner asks for two at every
        split of its batch."""
        nearest, out = self._nearest_grid(), []
        for batch_size, context in zip(batch_sizes, contexts, strict=True):
            cost = self._model_cost(batch_size, 0, context)
            factors = self._feedback_at(batch_size).at_each_k(nearest)
            out.append(cost if factors is None else cost * factors[0])
        return out

    def _model_cost(self, batch_size: int, k: int, context: int | None) -> float:
        """The model's cost of one k at `context`, uncorrected (CostModel.at_context for a
        single k: the plain costs of every split, and every step's feedback, read one)."""
        cost = self._model_curve(batch_size)[k]
        term = self.costs.context
        if context is None or not term.moves:
            return cost
        return _moved(cost, batch_size * self._slopes()[k], context - term.tokens)

    def _slopes(self) -> tuple[float, ...]:
        """The context term's per-key slope of each k = 0..max_k (the costs never change;
        the planner moves ~2n curves a step)."""
        if not self._context_slopes:
            self._context_slopes = tuple(
                self.costs.context.per_key(k) for k in range(self.max_k + 1)
            )
        return self._context_slopes

    def observe_cost(
        self, batch_size: int, k: int, seconds: float, context: int | None = None
    ) -> None:
        if seconds <= 0:
            return
        ratio = math.log(seconds / self._model_cost(batch_size, k, context))
        grid_k = self._nearest_grid()[k]
        self._feedback_at(batch_size).observe(grid_k, ratio, self.feedback_weight)

    def _nearest_grid(self) -> list[int]:
        """The grid k nearest to each k = 0..max_k (ties: the smaller)."""
        if not self._nearest:
            grid = self.costs.num_drafts
            self._nearest = [
                min(grid, key=lambda g: (abs(g - k), g)) for k in range(self.max_k + 1)
            ]
        return self._nearest

    def best(self, batch_size: int, rates: Sequence[float], extra: float = 0.0) -> int:
        """argmax_k tokens per second at this batch size (ties: the smaller k), drafting
        (k > 0) only when it beats plain by more than `margin`; `extra`: seconds added to
        every drafting step."""
        costs = self.curve(batch_size)
        tokens, survive, scores = 1.0, 1.0, [1.0 / costs[0]]
        for k in range(1, self.max_k + 1):
            survive *= rates[k - 1]
            tokens += survive
            scores.append(tokens / (costs[k] + extra))
        k = max(range(len(scores)), key=lambda j: (scores[j], -j))
        return k if scores[k] > (1.0 + self.margin) * scores[0] else 0

    def choose(self, batch_size: int, stats: AcceptanceStats, pending: int = 0) -> int:
        """k for the next step of `batch_size` rows; `pending`: positions of drafter
        context those rows lack (put off by plain steps), which drafting must project
        first. Exploring from k = 0 pays that whole catch-up, so it is skipped unless the
        catch-up costs at most `EXPLORE_CATCH_UP` of a plain step (a busy server stays
        plain; a quiet one still looks again now and then)."""
        if self.mode == "fixed" or self.max_k == 0:
            return self.max_k
        catch_up = pending * self.costs.catch_up_per_position
        k = self.best(batch_size, stats.rates(), catch_up / max(1, self.catch_up_horizon))
        if not self.exploration_due(k > 0):
            return k
        if k == 0 and catch_up > EXPLORE_CATCH_UP * self.curve(batch_size)[0]:
            return k  # too dear to look now: at the next step, perhaps
        self.explored(k > 0)
        return min(self.max_k, k + max(2, k // 2))

    def exploration_due(self, drafting: bool) -> bool:
        """Counts a step; True when it is time to verify more drafts than planned."""
        if drafting or not self._interval:
            self._interval = self.explore_every  # drafting pays again: explore as usual
        self._steps += 1
        return bool(self.explore_every) and self._steps >= self._interval

    def explored(self, drafting: bool) -> None:
        """A look was taken; one from plain decoding doubles the wait for the next."""
        self._steps = 0
        if not drafting:
            self._interval = min(2 * self._interval, EXPLORE_BACKOFF * self.explore_every)


def conditional_rates(accepted_per_pos: Sequence[float], num_drafts: float) -> list[float]:
    """Per-position conditional acceptance from vLLM-style counters: accepted_per_pos[j]
    = steps that accepted draft j + 1 (and so every earlier one), num_drafts = steps."""
    rates, before = [], float(num_drafts)
    for accepted in accepted_per_pos:
        rates.append(accepted / before if before > 0 else 0.0)
        before = float(accepted)
    return rates


def speculative_tokens_per_batch_size(
    costs: CostModel, rates: Sequence[float], batch_sizes: Iterable[int], max_k: int
) -> dict[int, int]:
    """vLLM's static table (batch size -> num_speculative_tokens): at each batch size the
    k that maximises expected tokens per second under `costs` at acceptance `rates`
    (per position, conditional), 0 unless it beats plain decoding by the policy's margin.
    Consecutive equal entries are kept: vLLM looks the running batch size up in the table
    (the largest key not above it)."""
    policy = SpecPolicy(costs, max_k, explore_every=0)
    return {b: policy.best(b, rates) for b in sorted(set(batch_sizes))}


def vllm_schedule(
    costs: CostModel, rates: Sequence[float], max_num_seqs: int, max_k: int
) -> list[tuple[int, int, int]]:
    """vLLM's `num_speculative_tokens_per_batch_size`: inclusive batch-size ranges
    (start, end, k) covering 1..max_num_seqs, each batch size given the k that
    `speculative_tokens_per_batch_size` picks (equal neighbours merged into one range)."""
    table = speculative_tokens_per_batch_size(costs, rates, range(1, max_num_seqs + 1), max_k)
    ranges: list[tuple[int, int, int]] = []
    for batch, k in table.items():
        if ranges and ranges[-1][2] == k:
            ranges[-1] = (ranges[-1][0], batch, k)
        else:
            ranges.append((batch, batch, k))
    return ranges
