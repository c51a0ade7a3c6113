"""Speculation per request: each running request's own acceptance, and how one engine step
splits its rows between a drafting group and a plain group. No torch.

Acceptance is a property of each request (its temperature, its task, its language), not of
the worker: a worker-wide estimate lets four sampled requests switch drafting off for the
greedy request after them. So every running request carries its own `AcceptanceStats`:

- It starts from the recent acceptance of requests in its temperature band (`BandPriors`;
  greedy, low and high temperature), weighed as four pseudo-trials that its own drafting
  steps soon outweigh. A band starts from the optimistic prior, and sampled traffic moves
  only its own band: a greedy request after sampled ones is not locked out. A request
  unlike its band that the band's estimate keeps plain is looked at by the exploration
  steps (`explored`), which try every row when that is cheap (a lone request, not a busy
  batch); a kept plain plan (`REPLAN_EVERY`) still counts its steps toward the next look.
- Only its own drafting steps teach it. Plain steps teach nothing, so a request kept plain
  by a pessimistic estimate would stay plain for good: the plan weighs each estimate
  `OPTIMISM` standard errors up (`AcceptanceStats.optimistic_rates`; divided by the batch
  size, whose every row waits for the drafting forward), so a request drafts
  on until its own trials rule out that drafting pays, not merely until two early
  rejections make it look unlikely. That doubt decides whether a row drafts; its point
  estimates decide how many drafts its group verifies (the doubt on deep positions, seldom
  reached, would otherwise always favour the widest block).
- A request's acceptance moves within its answer (a short prompt's first tokens are
  guessed worse than what follows), so its own evidence fades over the steps it spends
  plain (`AcceptanceStats.fade`, toward its band's prior): a few rejections early on keep
  it plain for some steps, not to the end (it returns to where a new request starts,
  without the probes below, which a request takes once).
- Acceptance comes in stretches: where the drafter predicts the text (a name repeated, a
  line it has seen), every draft of a block is accepted and the next block mostly is too,
  while elsewhere the first drafts are mostly rejected. So a row whose last block was
  accepted whole is planned by what followed such blocks (its own estimates from those
  steps, started from its band's), which drafts further than its estimates over all its
  steps. Replayed on recorded greedy acceptance at one row (four of the bench's workloads),
  this read 0.5-2 % more tokens per second (loadtest/RESULTS.md).
- Drafts past a row's last token (`max_tokens`, the context) are verified for nothing: a
  row's expected tokens stop at its `tokens_left`, so a short answer's last steps verify
  few drafts or none.
- A band's recent acceptance can mislead about a request unlike the band's others (long
  code prompts after short ones accept far more), and a request kept plain by its prior
  never drafts to prove otherwise. So each new request is on probation until it has
  drafted `PROBATION_STEPS` times: a step takes its probation rows into the drafting group
  (`probed`) whenever what that adds to the step, paid by every row of the batch, is at
  most `PROBE_SHARE` of the probed rows' remaining decoding (their catch-up included). A
  lone request is always probed early; a busy batch, whose every row would wait, is not.

A step then runs at most two forwards (`plan_step`): a drafting group verifying K drafts per
row (one padded block: every row of the group drafts K, which costs the group nothing more
than its widest row), and a plain group (k = 0: no drafter forward, no drafter context).
The split maximises the step's expected tokens per second: rows are taken into the drafting
group in the order of their own expected tokens, so a row that accepts little never pulls a
row that accepts much down to plain decoding by averaging, and is never made to draft
because of it. A row enters the drafting group only if the tokens it adds pay for what it
costs the step (the drafter's forward, the wider verify, its catch-up of drafter context),
and the plain rows' wait for the drafting forward is counted in that cost.

Seeded sampled rows are planned like any other: their draws are keyed by position
(speculative.accept_keyed), so their text is the same whatever the plan gives them.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.adaptive import EXPLORE_CATCH_UP, AcceptanceStats, SpecPolicy, cumulative_tokens

BANDS = ("greedy", "low", "high")


def band_of(temperature: float) -> str:
    """Temperature band: drafts are deterministic, so their acceptance falls with it."""
    if temperature <= 0:
        return "greedy"
    return "low" if temperature <= 0.5 else "high"


@dataclass
class BandPriors:
    """Recent acceptance per temperature band, the starting point of each new request; kept
    apart for steps right after one that accepted every draft (`after_run`, see RowPlanner)."""

    max_k: int
    # Weight of the band's estimate in a new request's own: a request's first drafting
    # steps are too few to estimate 15 positions alone (its plan would swing from step to
    # step), so they refine the band's estimate rather than replace it.
    prior_trials: float = 4.0
    bands: dict[str, AcceptanceStats] = field(default_factory=dict)
    after_run: dict[str, AcceptanceStats] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in BANDS:
            self.bands.setdefault(name, AcceptanceStats(self.max_k))
            self.after_run.setdefault(name, AcceptanceStats(self.max_k))

    def _bands(self, after_run: bool) -> dict[str, AcceptanceStats]:
        return self.after_run if after_run else self.bands

    def stats_for(self, temperature: float, after_run: bool = False) -> AcceptanceStats:
        """A new request's own estimates: its band's current rates as the prior, behind
        `prior_trials` pseudo-trials (a fresh band's rates are the optimistic prior)."""
        band = self._bands(after_run)[band_of(temperature)]
        return AcceptanceStats(
            self.max_k,
            band.halflife_steps,
            prior_weight=self.prior_trials,
            prior_rates=tuple(band.rates()),
        )

    def observe_step(self, rows: Sequence[tuple[float, int, int]], after_run: bool = False) -> None:
        """One step's (temperature, num_drafted, num_accepted) of its drafting rows: one
        observation per band, so a band's memory goes by steps as a request's does."""
        by_band: dict[str, list[tuple[int, int]]] = {}
        for temperature, drafted, accepted in rows:
            by_band.setdefault(band_of(temperature), []).append((drafted, accepted))
        bands = self._bands(after_run)
        for name, seen in by_band.items():
            bands[name].observe(seen)


class RowView(NamedTuple):
    """What the plan needs of one running row (a tuple: the planner builds one per row at
    every step it weighs)."""

    rates: Sequence[float]  # its own conditional acceptance per position
    # Its point estimates, when `rates` are raised by their doubt (None: `rates` are): they
    # set how many drafts a drafting group verifies (see plan_step).
    point: Sequence[float] | None = None
    pending: int = 0  # positions of drafter context it lacks (put off by plain steps)
    context: int | None = None  # tokens in its cache (None: the cost grid's context)
    probation: bool = False  # has not drafted PROBATION_STEPS times yet
    tokens_left: int = 0  # the most tokens it may still generate (0: not known)
    # cumulative_tokens of `rates` and of `point`, when the caller keeps them (RowPlanner:
    # per request, until its estimates move); None: computed here
    gains: Sequence[float] | None = None
    point_gains: Sequence[float] | None = None


@dataclass(frozen=True)
class StepPlan:
    """K drafts for every row in the drafting group, none for the others."""

    num_drafts: int
    drafting: tuple[bool, ...]

    @property
    def any_drafting(self) -> bool:
        return self.num_drafts > 0 and any(self.drafting)

    @classmethod
    def plain(cls, n: int) -> StepPlan:
        return cls(0, (False,) * n)


def plan_step(policy: SpecPolicy, rows: Sequence[RowView]) -> StepPlan:
    """The split (drafting group at K, plain group) with the most expected tokens per
    second of decoding. A prefill in the same iteration is not counted: it is spent
    whatever the step does, so the time per generated token is the decode step's alone.
    Each group's cost is taken at its longest row's context. Drafting must beat plain
    decoding by the policy's margin, and may slow no row by more than `SLOWDOWN`."""
    n = len(rows)
    if policy.mode == "fixed" or policy.max_k == 0:
        return StepPlan(policy.max_k, (True,) * n)
    gains = [r.gains or cumulative_tokens(r.rates, policy.max_k, r.tokens_left) for r in rows]
    order = sorted(range(n), key=lambda i: -gains[i][-1])
    head, tail = _running_contexts([rows[i].context for i in order])
    per_position = policy.costs.catch_up_per_position / max(1, policy.catch_up_horizon)
    plain = policy.plain_cost(n, head[n])
    best_score, best = n / plain, StepPlan.plain(n)
    threshold = best_score * (1.0 + policy.margin)
    slowest = plain * (1.0 + SLOWDOWN)  # a step yielding one token per row may take this
    ks = _candidate_ks(policy)
    # The first m rows of `order` draft, the others decode plain. A split's forward for its
    # plain rows, and its drafting forward at k = 0 (no k costs less: SpecPolicy.curve),
    # rule out most splits before any curve: two forwards seldom pass the bound.
    firsts = policy.plain_costs(range(1, n), head[1:n])
    rests = policy.plain_costs(range(n - 1, 0, -1), tail[1:n])
    catches = list(itertools.accumulate(rows[i].pending * per_position for i in order))
    # The best plan's seconds at each k, and which of those ks are within the bound.
    chosen: tuple[list[float], list[bool]] = ([], [])
    for m in range(1, n + 1):
        rest = catches[m - 1]
        if m < n:
            rest += rests[m - 1]
            if firsts[m - 1] + rest > slowest:
                continue
        group = order[:m]
        drafting = policy.curve(m, head[m])
        seconds = [drafting[k] + rest for k in ks]
        # A plain row commits one token a step, a drafting row at least its group's least.
        if m < n:
            bounded = [s <= slowest for s in seconds]
        else:
            least = [min(gains[i][k] for i in group) for k in ks]
            bounded = [s <= a * slowest for s, a in zip(seconds, least, strict=True)]
        for j, k in enumerate(ks):
            if not bounded[j]:
                continue
            tokens = functools.reduce(operator.add, (gains[i][k] - 1.0 for i in group), float(n))
            score = tokens / seconds[j]
            if score > threshold and score > best_score:
                best_score, members = score, set(group)
                best = StepPlan(k, tuple(i in members for i in range(n)))
                chosen = (seconds, bounded)
    if not best.any_drafting or all(r.point is None for r in rows):
        return best
    return StepPlan(_how_far(policy, rows, best.drafting, ks, *chosen), best.drafting)


def _how_far(
    policy: SpecPolicy,
    rows: Sequence[RowView],
    group: Sequence[bool],
    ks: Sequence[int],
    seconds: Sequence[float],
    bounded: Sequence[bool],
) -> int:
    """The k (of those within the bound) at which the drafting group's point estimates
    commit the most tokens per second. The doubt decided that the group drafts (what its
    rows may yet show); what they are expected to accept decides how far (the doubt on
    positions seldom reached would otherwise always favour the widest block)."""
    expected = [float(len(rows))] * len(ks)
    for r, drafting in zip(rows, group, strict=True):
        if drafting:
            gain = r.point_gains or cumulative_tokens(
                r.point or r.rates, policy.max_k, r.tokens_left
            )
            expected = [t + (gain[k] - 1.0) for t, k in zip(expected, ks, strict=True)]
    scores = [t / s if ok else 0.0 for t, s, ok in zip(expected, seconds, bounded, strict=True)]
    return ks[max(range(len(ks)), key=lambda j: (scores[j], -j))]


# The most a plan may slow any row: its expected tokens per second against an all-plain
# step's one token. A burst ends with its slowest requests, the ones that accept least, so
# tokens a plan gains for the others by making them wait (for a drafting forward beside
# theirs, or in a block they accept little of) are lost again at the burst's end. Traced
# at c = 4, greedy and sampled rows mixed: such steps took twice a plain step, and the
# sampled requests finished last.
SLOWDOWN = 0.03


def _running_contexts(
    contexts: Sequence[int | None],
) -> tuple[list[int | None], list[int | None]]:
    """head[m]: the longest context among the first m rows; tail[m]: among the rest."""

    def longest(a: int | None, b: int | None) -> int | None:
        return b if a is None else a if b is None else max(a, b)

    head: list[int | None] = [None]
    for c in contexts:
        head.append(longest(head[-1], c))
    tail: list[int | None] = [None]
    for c in reversed(contexts):
        tail.append(longest(tail[-1], c))
    tail.reverse()
    return head, tail


def _candidate_ks(policy: SpecPolicy) -> list[int]:
    """The grid's draft counts (the costs are measured there; between them they are
    interpolated), and max_k."""
    grid = {k for k in policy.costs.num_drafts if 0 < k <= policy.max_k}
    return sorted(grid | {policy.max_k})


# The most a look at the plain rows may add to the step, in plain steps of the batch (its
# wider verify and the plain rows' catch-up). About what a drafting step adds at one row:
# a lone request is looked at, a busy batch stays plain (its plain rows' estimates come
# from their band and their own drafting steps).
EXPLORE_COST = 0.6


def explored(policy: SpecPolicy, plan: StepPlan, rows: Sequence[RowView]) -> StepPlan:
    """Every `explore_every` steps (backed off while looks find nothing) the step verifies
    a few more drafts than planned, so each row's estimates of positions it has not been
    trying stay fresh: the drafting group's rows always; every row when that costs the
    step at most `EXPLORE_COST` of a plain step, or is `_affordable` for the rows' decoding
    left (a lone request whose drafter forward alone costs more), and the catch-up of the
    plain rows' drafter context at most `EXPLORE_CATCH_UP`."""
    n = len(rows)
    drafting = plan.any_drafting
    if not policy.exploration_due(drafting):
        return plan
    k = min(policy.max_k, plan.num_drafts + max(2, plan.num_drafts // 2))
    plain = policy.plain_cost(n)
    catch = sum(r.pending for r in rows) * policy.costs.catch_up_per_position
    look = _look_cost(policy, plan, k)
    everyone = catch <= EXPLORE_CATCH_UP * plain and (
        look <= EXPLORE_COST * plain or _affordable(look + catch, plain, rows, range(n))
    )
    if not drafting and not everyone:
        return plan  # too dear to look now: at the next step, perhaps
    policy.explored(drafting)
    return StepPlan(k, (True,) * n if everyone else plan.drafting)


def _look_cost(policy: SpecPolicy, plan: StepPlan, k: int) -> float:
    """What verifying k drafts for every row adds to the planned step."""
    n, m = len(plan.drafting), sum(plan.drafting) if plan.any_drafting else 0
    planned = (policy.curve(m)[plan.num_drafts] if m else 0.0) + (
        policy.plain_cost(n - m) if m < n else 0.0
    )
    return policy.curve(n)[k] - planned


# Standard errors added to each row's acceptance estimates when planning a lone request
# (AcceptanceStats.optimistic_rates); over a batch of n rows, OPTIMISM / n: the drafting
# forward that tests a row's doubtful estimate delays every row of the batch, so a busy
# batch plans nearer its point estimates (at c=16-32 the full bonus drafted at a loss).
OPTIMISM = 1.0
# A new request drafts this many times, when the step can afford it, before its own
# estimates alone decide (behind its band's prior); and what the step may pay for that, as
# a share of the probed rows' remaining decoding time.
PROBATION_STEPS = 2
PROBE_SHARE = 0.05
# The drafts a probe verifies when the step has no drafting group to join.
PROBE_K = 7


def probed(policy: SpecPolicy, plan: StepPlan, rows: Sequence[RowView]) -> StepPlan:
    """The plan with its probation rows in the drafting group, if the step can afford them:
    the added seconds (the wider or extra forward and their catch-up), times the rows that
    wait for them, within `PROBE_SHARE` of the plain decoding the probed rows have left."""
    n = len(rows)
    new = [i for i, r in enumerate(rows) if r.probation and not plan.drafting[i]]
    if not new or policy.mode == "fixed" or policy.max_k == 0:
        return plan
    k = plan.num_drafts if plan.any_drafting else min(PROBE_K, policy.max_k)
    group = tuple(d or i in new for i, d in enumerate(plan.drafting))
    wider = StepPlan(k, group)
    per_position = policy.costs.catch_up_per_position
    extra = _step_seconds(policy, wider, rows) - _step_seconds(policy, plan, rows)
    extra += sum(rows[i].pending for i in new) * per_position
    plain = _step_seconds(policy, StepPlan.plain(n), rows)
    return wider if _affordable(extra, plain, rows, new) else plan


def _affordable(extra: float, plain: float, rows: Sequence[RowView], looked: Iterable[int]) -> bool:
    """Whether a look at the `looked` rows is worth its cost: the seconds it adds to the
    step, times the rows that wait for it, within `PROBE_SHARE` of the plain decoding those
    rows have left (the fewest tokens left of any; not known: none)."""
    left = min(rows[i].tokens_left for i in looked)
    return extra * len(rows) <= PROBE_SHARE * plain * left


def _step_seconds(policy: SpecPolicy, plan: StepPlan, rows: Sequence[RowView]) -> float:
    """The planned step's forwards, each group's at its longest row's context."""
    total = 0.0
    for members, k in ((True, plan.num_drafts), (False, 0)):
        group = [r.context or 0 for r, d in zip(rows, plan.drafting, strict=True) if d == members]
        if group:
            total += policy.curve(len(group), max(group) or None)[k]
    return total


# A plain plan is kept this many steps while its batch stays the same: plain steps change
# no row's estimates and the costs move slowly with the contexts, so re-planning every step
# would only spend host time (1-2 % of a plain step at 16 rows) for the same answer. A
# kept step still counts toward the policy's next look, which the next re-plan weighs (a
# look that is due but too dear is so tried again every few steps, not at every step).
REPLAN_EVERY = 8
# Within those steps a kept plain plan also stands for a batch of n rows of which fewer than
# n / CHURN_SHARE have changed since it was weighed, an arrival or a departure counting half
# a row (a request that replaced another: one row). Each row is a 1/n share of the step's
# tokens, so a few arrivals among many rows seldom tip a plan the others keep plain, and a
# busy closed loop changes a row every other step (at c = 32 and answers of 32-96 tokens the
# batch was weighed again at 115 of 251 steps, 2 % of the engine's time). A batch of four
# rows or fewer (SMALL_BATCH), where one row can tip the plan, is weighed again at every
# change.
CHURN_SHARE = 8
SMALL_BATCH = 4
# Patience: a batch of more than SMALL_BATCH rows weighed plain again (its plan ran out, or
# its rows changed) keeps its next plan twice as long and through twice the change, up to
# MOST_PATIENCE doublings (32 steps, half the rows); any drafting, or a weighing that
# drafts, starts again from none. A busy batch that stays plain was weighed every 6-9 steps
# at 0.5 ms a weighing at 32 rows, for the same plain plan (one row in eight changed, or a
# look due, then too dear: a busy server stays plain), half of what a DFlash worker's
# plain step spent on its host beyond a plain worker's (measured in process:
# loadtest/RESULTS.md, "A plain step's host time, again"). A look due there, or a greedy
# arrival, waits up to 32 steps.
MOST_PATIENCE = 2


class _Kept(NamedTuple):
    """A plain plan, the rows it was weighed for, the steps it has been kept, and the
    planner's patience with the batch."""

    keys: frozenset[Hashable]
    plan: StepPlan
    age: int
    patience: int = 0

    def stands_for(self, batch: Sequence[Hashable]) -> bool:
        if self.age >= REPLAN_EVERY << self.patience:
            return False
        if len(batch) == len(self.keys) and self.keys.issuperset(batch):
            return True  # the same rows (a batch's keys are distinct)
        changed = len(self.keys.symmetric_difference(batch))
        # An arrival and a departure: one row.
        return changed * (CHURN_SHARE >> self.patience) < 2 * len(batch)

    def patience_next(self, drafting: bool, rows: int) -> int:
        """The patience of the plan weighed in this one's place, if that plan is plain."""
        if drafting or rows <= SMALL_BATCH:
            return 0
        return min(self.patience + 1, MOST_PATIENCE)


@dataclass
class RowPlanner:
    """Per-request speculation for one engine: each running request's own estimates, the
    bands' priors, and each step's plan (a plain one kept while its batch stays about the
    same). Requests are named by any hashable key."""

    policy: SpecPolicy
    priors: BandPriors
    _own: dict[Hashable, AcceptanceStats] = field(default_factory=dict)  # every drafting step
    # A request's estimates from its steps right after a block it accepted whole (a stretch
    # the drafter predicts, which the next block likely continues), started from its band's
    # of the same kind; and the requests whose last step was such a block: planned by those.
    _after_run: dict[Hashable, AcceptanceStats] = field(default_factory=dict)
    _in_run: set[Hashable] = field(default_factory=set)
    _kept: _Kept | None = None
    # Steps on which every request plain-decoded, and per request how many of them its own
    # estimates have faded by: such a step's fades are applied when the request is next
    # read or observed (a busy batch's plain steps then cost one count, not a fade a row).
    _plain_steps: int = 0
    _faded_to: dict[Hashable, int] = field(default_factory=dict)

    def add(self, key: Hashable, temperature: float) -> None:
        self._own[key] = self.priors.stats_for(temperature)
        self._after_run[key] = self.priors.stats_for(temperature, after_run=True)
        self._faded_to[key] = self._plain_steps

    def remove(self, key: Hashable) -> None:
        self._own.pop(key, None)
        self._after_run.pop(key, None)
        self._faded_to.pop(key, None)
        self._in_run.discard(key)

    def _faded(self, key: Hashable) -> AcceptanceStats:
        """A request's own estimates, with the plain steps it has not faded by yet."""
        own = self._own[key]
        behind = self._plain_steps - self._faded_to[key]
        if behind:
            own.fade(behind)
            self._faded_to[key] = self._plain_steps
        return own

    def _estimates(self, key: Hashable) -> AcceptanceStats:
        """What a row's next step is planned by (see `observe`)."""
        return self._after_run[key] if key in self._in_run else self._faded(key)

    def plan(
        self,
        keys: Sequence[Hashable],
        contexts: Sequence[int],
        pending: Callable[[int], int],
        tokens_left: Sequence[int] | None = None,
    ) -> StepPlan:
        """The step's plan for these rows; `pending(i)`: row i's drafter context to catch
        up (asked only when the rows are weighed again); `tokens_left`: the most each may
        still generate (None: no probation probes)."""
        batch = tuple(keys)
        kept = self.kept_plan(batch)
        if kept is not None:
            return kept
        return self.weigh(batch, contexts, pending, tokens_left)

    def kept_plan(self, batch: Sequence[Hashable]) -> StepPlan | None:
        """The kept plain plan, if it still stands for these rows (counted as a step of
        it); None: the rows must be weighed. The engine asks this first, at every step, and
        builds what weighing reads only when it must."""
        kept = self._kept
        if kept is None or not kept.stands_for(batch):
            return None
        self.policy.exploration_due(False)  # counted: a look due is weighed at the re-plan
        n = len(batch)
        plan = kept.plan if len(kept.plan.drafting) == n else StepPlan.plain(n)
        self._kept = kept._replace(plan=plan, age=kept.age + 1)
        return plan

    def weigh(
        self,
        keys: Sequence[Hashable],
        contexts: Sequence[int],
        pending: Callable[[int], int],
        tokens_left: Sequence[int] | None = None,
    ) -> StepPlan:
        """The rows weighed afresh (`plan`'s arguments); a plain plan is kept for the
        next steps."""
        batch = tuple(keys)
        left = [0] * len(batch) if tokens_left is None else tokens_left
        # What a row's drafting teaches is paid by every row waiting for its forward.
        doubt = OPTIMISM / len(batch)
        views = [
            _view(
                self._estimates(key),
                doubt,
                pending(i),
                contexts[i],
                left[i],
                self._own[key].drafted_steps < PROBATION_STEPS,
            )
            for i, key in enumerate(batch)
        ]
        planned = plan_step(self.policy, views)
        looked = probed(self.policy, explored(self.policy, planned, views), views)
        if planned.any_drafting or not looked.any_drafting or len(batch) == 1:
            chosen = looked  # riding along a drafting step, or a lone request's own look
        else:
            chosen = looked if self._could_draft(batch, views, looked) else planned
        before = self._kept
        patience = 0 if before is None else before.patience_next(chosen.any_drafting, len(batch))
        self._kept = None if planned.any_drafting else _Kept(frozenset(batch), planned, 0, patience)
        return chosen

    def _could_draft(
        self, batch: Sequence[Hashable], views: Sequence[RowView], looked: StepPlan
    ) -> bool:
        """Whether a look (or probe) that turns a plain step into a drafting one can
        change the plan: the plan drafts with each looked row as hopeful as a lone request
        is (OPTIMISM standard errors up), the others as they are. Its drafting forward
        delays every row of the batch, so a look at a row that another row's estimates
        keep plain (a greedy row beside a sampled one: a split's two forwards, or a block
        the sampled row accepts nothing of, slow it past `SLOWDOWN`) is not taken."""
        hopeful = [
            _view(
                self._estimates(key),
                OPTIMISM,
                view.pending,
                view.context,
                view.tokens_left,
                view.probation,
            )
            if looking
            else view
            for key, view, looking in zip(batch, views, looked.drafting, strict=True)
        ]
        return plan_step(self.policy, hopeful).any_drafting

    def observe(
        self,
        keys: Sequence[Hashable],
        temperatures: Sequence[float],
        results: Sequence[tuple[int, int]],
    ) -> None:
        """Each row's (num_drafted, num_accepted) into its own estimates, and per band into
        the priors of the requests still to come; a step right after a block accepted whole
        also into the row's (and band's) estimates after such blocks. A row whose every draft
        was accepted is planned next by those; after any other step, by all its steps (a
        plain step ends a run: the text moved on with no block to tell whether it held)."""
        seen: list[tuple[float, int, int]] = []
        seen_after_run: list[tuple[float, int, int]] = []
        if not any(drafted for drafted, _ in results):
            self.observe_plain(keys)
            return
        for key, temperature, (drafted, accepted) in zip(keys, temperatures, results, strict=True):
            if drafted:
                self._faded(key).observe([(drafted, accepted)])
                seen.append((temperature, drafted, accepted))
                if key in self._in_run:
                    self._after_run[key].observe([(drafted, accepted)])
                    seen_after_run.append((temperature, drafted, accepted))
            else:
                self._own[key].fade()
            if drafted and accepted == drafted:
                self._in_run.add(key)
            else:
                self._in_run.discard(key)
        if seen:
            self._kept = None  # estimates moved: weigh the rows again
            self.priors.observe_step(seen)
        if seen_after_run:
            self.priors.observe_step(seen_after_run, after_run=True)

    def observe_plain(self, keys: Sequence[Hashable]) -> None:
        """`observe` for a step on which no row drafted: each row's estimates fade, and no
        row is in a run (the engine's every plain step; spared the per-row results)."""
        if len(keys) == len(self._own):  # every request: one count
            self._plain_steps += 1
        else:  # some request not in this step (one admitted for prefill)
            own = self._own
            for key in keys:
                own[key].fade()
        if self._in_run:
            self._in_run.difference_update(keys)


def _view(
    stats: AcceptanceStats,
    doubt: float,
    pending: int,
    context: int | None,
    left: int,
    probation: bool,
) -> RowView:
    """A running request's row as the plan sees it, its token curves kept by its stats."""
    return RowView(
        stats.optimistic_rates(doubt),
        stats.rates(),
        pending,
        context=context,
        probation=probation,
        tokens_left=left,
        gains=stats.tokens_by_k(doubt, left),
        point_gains=stats.tokens_by_k(0.0, left),
    )
