"""Speculation per request: band priors, the split of a step into drafting and plain groups,
and exploration."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from engine import row_speculation
from engine.adaptive import (
    FADE_CHUNK,
    AcceptanceStats,
    ContextTerm,
    CostModel,
    SpecPolicy,
    cumulative_tokens,
)
from engine.row_speculation import (
    CHURN_SHARE,
    MOST_PATIENCE,
    OPTIMISM,
    PROBE_K,
    REPLAN_EVERY,
    SMALL_BATCH,
    BandPriors,
    RowPlanner,
    RowView,
    StepPlan,
    band_of,
    explored,
    plan_step,
    probed,
)

MAX_K = 15
HIGH = [0.9] * MAX_K  # a greedy row on predictable code
LOW = [0.05] * MAX_K  # a sampled row at temperature 1.0


def _costs(forward: float, per_token: float, drafter: float = 0.3) -> CostModel:
    """A forward costs `forward` plus `per_token` for each token it verifies; a drafting
    forward (k > 0) pays `drafter` more for the drafter's forward."""
    bs, ks = (1, 2, 4, 8, 16, 32), (0, 1, 3, 7, 15)

    def step(b: int, k: int) -> float:
        return forward + (drafter if k else 0.0) + per_token * b * (k + 1)

    return CostModel(bs, ks, tuple(tuple(step(b, k) for k in ks) for b in bs))


def _policy(forward: float = 1.0, per_token: float = 0.05, drafter: float = 0.3) -> SpecPolicy:
    return SpecPolicy(_costs(forward, per_token, drafter), MAX_K, explore_every=0)


def test_bands_split_greedy_from_sampled() -> None:
    assert [band_of(t) for t in (0.0, 0.3, 0.5, 0.7, 1.5)] == [
        "greedy",
        "low",
        "low",
        "high",
        "high",
    ]


def test_sampled_traffic_does_not_lower_a_new_greedy_request_s_prior() -> None:
    priors = BandPriors(MAX_K)
    for _ in range(200):  # sampled requests that accept nothing
        priors.observe_step([(1.0, MAX_K, 0)] * 4)
    fresh = AcceptanceStats(MAX_K).rates()
    assert priors.stats_for(0.0).rates() == pytest.approx(fresh)
    assert priors.stats_for(1.0).rates()[0] < 0.1  # the next sampled one starts low


def test_a_band_s_history_weighs_only_a_few_trials_in_a_new_request() -> None:
    priors = BandPriors(MAX_K, prior_trials=8.0)
    for _ in range(50):
        priors.observe_step([(0.0, MAX_K, MAX_K)] * 8)  # greedy code: every draft accepted
    greedy = priors.stats_for(0.0)
    assert greedy.rates() == pytest.approx(priors.bands["greedy"].rates(), rel=0.01)
    assert greedy.rates()[0] > 0.95 and greedy.tried == [0.0] * MAX_K
    for _ in range(8):  # a greedy request unlike its band: its own steps soon outweigh it
        greedy.observe([(MAX_K, 0)])
    assert greedy.rates()[0] < 0.55
    for _ in range(8):
        greedy.observe([(MAX_K, 0)])
    assert greedy.rates()[0] < 0.4


def test_a_low_row_does_not_pull_a_high_row_to_plain() -> None:
    """A worker-wide estimate that sampled traffic brought down keeps a greedy request
    plain; its own estimate drafts, and in a batch with a sampled row, still drafts."""
    policy = _policy(forward=1.0, per_token=0.02, drafter=1.0)
    worker_wide = AcceptanceStats(MAX_K)
    for _ in range(100):
        worker_wide.observe([(MAX_K, 0)] * 4)
    assert policy.choose(1, worker_wide) == 0
    greedy = BandPriors(MAX_K).stats_for(0.0)
    assert plan_step(policy, [RowView(greedy.rates())]).any_drafting
    assert plan_step(policy, [RowView(HIGH), RowView(HIGH)]).any_drafting
    assert plan_step(policy, [RowView(LOW), RowView(LOW)]) == StepPlan.plain(2)


def test_a_split_that_slows_its_plain_rows_is_not_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens cost much: the low row would only pad the block. A plain forward of its own
    would make it wait for the drafting forward each step, more than SLOWDOWN over
    an all-plain step (the burst would end later, on it): the step stays plain. Without the
    bound, the high row would draft alone."""
    policy = _policy(forward=0.5, per_token=0.05, drafter=0.5)
    rows = [RowView(HIGH), RowView(LOW)]
    assert plan_step(policy, rows) == StepPlan.plain(2)
    monkeypatch.setattr(row_speculation, "SLOWDOWN", 10.0)
    assert plan_step(policy, rows).drafting == (True, False)


def test_one_padded_forward_when_a_second_forward_costs_more_than_padding() -> None:
    """Forwards cost much, tokens little: a row accepting half its drafts rides in the
    drafting block (its drafts are free, and it keeps its plain speed there) rather than
    paying for a forward of its own. A row accepting almost nothing would be slowed in the
    block by the drafter's forward: the step stays plain."""
    policy = _policy(forward=1.0, per_token=0.001)
    plan = plan_step(policy, [RowView(HIGH), RowView([0.5] * MAX_K)])
    assert plan.drafting == (True, True) and plan.num_drafts > 0
    assert plan_step(policy, [RowView(HIGH), RowView(LOW)]) == StepPlan.plain(2)


def test_the_plain_rows_wait_is_counted() -> None:
    """Drafting one greedy row costs seven sampled rows a second forward each step: with
    a dear drafter forward the step stays plain, since the batch would lose tokens/s."""
    policy = _policy(forward=1.0, per_token=0.02, drafter=1.0)
    assert plan_step(policy, [RowView(HIGH)] + [RowView(LOW)] * 7) == StepPlan.plain(8)


def test_nothing_drafts_when_no_row_pays_for_it() -> None:
    plan = plan_step(_policy(), [RowView(LOW)] * 4)
    assert plan == StepPlan.plain(4)


def test_pending_context_is_counted_against_a_row() -> None:
    costs = _costs(1.0, 0.02)
    dear = CostModel(costs.batch_sizes, costs.num_drafts, costs.seconds, 1.0)
    policy = SpecPolicy(dear, MAX_K, explore_every=0)
    fresh, behind = RowView(HIGH), RowView(HIGH, pending=10_000)
    assert plan_step(policy, [fresh]).any_drafting
    assert not plan_step(policy, [behind]).any_drafting


def test_two_early_rejections_do_not_lock_a_request_out() -> None:
    """A greedy request whose band accepts about half its first drafts: two rejections in
    a row put its point estimate under break-even, where it would stay (plain steps teach
    nothing). The plan weighs what the evidence does not rule out, so it drafts on until
    its own trials say otherwise; a row that has truly failed many times stays plain."""
    policy = _policy(forward=1.0, per_token=0.02, drafter=0.8)
    unlucky = AcceptanceStats(MAX_K, prior_weight=4.0, prior_rates=(0.5, *[0.7] * (MAX_K - 1)))
    assert plan_step(policy, [RowView(unlucky.rates())]).any_drafting
    unlucky.observe([(MAX_K, 0)])
    unlucky.observe([(MAX_K, 0)])
    assert not plan_step(policy, [RowView(unlucky.rates())]).any_drafting  # locked out
    assert plan_step(policy, [RowView(unlucky.optimistic_rates(OPTIMISM))]).any_drafting
    for _ in range(40):
        unlucky.observe([(MAX_K, 0)])
    assert not plan_step(policy, [RowView(unlucky.optimistic_rates(OPTIMISM))]).any_drafting


def test_a_busy_batch_plans_nearer_its_point_estimates() -> None:
    """The doubt is divided by the batch size: a lone unlucky request drafts on, eight of
    them (each drafting forward delays all eight) stay plain."""
    planner = RowPlanner(_policy(forward=1.0, per_token=0.002, drafter=0.8), BandPriors(MAX_K))
    keys = [f"r{i}" for i in range(8)]
    for key in keys:
        planner.add(key, 0.0)
        planner._own[key] = AcceptanceStats(
            MAX_K, prior_weight=4.0, prior_rates=(0.5, *[0.7] * (MAX_K - 1))
        )
        for _ in range(2):
            planner._own[key].observe([(MAX_K, 0)])
    assert planner.plan(keys[:1], [64], lambda i: 0).any_drafting
    assert planner.plan(keys, [64] * 8, lambda i: 0) == StepPlan.plain(8)


def test_drafts_past_a_row_s_last_token_add_nothing() -> None:
    """A row with 3 tokens left commits at most 3: it verifies at most the grid's 3 drafts
    (2 of them useful), one with a single token left decodes plain."""
    policy = _policy(forward=1.0, per_token=0.05, drafter=0.3)
    assert plan_step(policy, [RowView(HIGH, tokens_left=200)]).num_drafts == MAX_K
    assert plan_step(policy, [RowView(HIGH)]).num_drafts == MAX_K  # 0: not known
    assert 0 < plan_step(policy, [RowView(HIGH, tokens_left=3)]).num_drafts <= 3
    assert plan_step(policy, [RowView(HIGH, tokens_left=1)]) == StepPlan.plain(1)


def test_the_doubt_decides_whether_a_row_drafts_its_point_estimates_how_far() -> None:
    """Raised by their doubt, a row's deep positions look accepted; its point estimates
    say they are not: the group verifies the few drafts the point estimates pay for. A row
    whose point estimates would not draft at all still drafts (the doubt decided so)."""
    policy = _policy(forward=1.0, per_token=0.05, drafter=0.3)
    shallow = [0.9] * 3 + [0.1] * (MAX_K - 3)
    assert plan_step(policy, [RowView(HIGH)]).num_drafts == MAX_K
    assert plan_step(policy, [RowView(HIGH, shallow)]).num_drafts == 3
    doubtful = plan_step(policy, [RowView(HIGH, LOW)])
    assert doubtful.any_drafting and doubtful.num_drafts == 1


def test_a_lone_request_is_looked_at_when_its_decoding_left_pays_for_the_look() -> None:
    """A drafter forward dearer than EXPLORE_COST of a plain step: a lone plain request
    is still looked at while the look is a small share of the decoding it has left."""
    policy = SpecPolicy(_costs(1.0, 0.02, drafter=0.8), MAX_K, explore_every=1)
    plain = StepPlan.plain(1)
    assert explored(policy, plain, [RowView(LOW, tokens_left=200)]).any_drafting
    assert explored(policy, plain, [RowView(LOW, tokens_left=10)]) == plain
    assert explored(policy, plain, [RowView(LOW)]) == plain  # what it has left: not known


def test_a_kept_plain_plan_still_counts_toward_the_next_look() -> None:
    """The planner keeps a plain plan for REPLAN_EVERY steps; its steps count toward the
    policy's next look (backed off while looks find nothing), which the next re-plan takes:
    without the count, the first look would come after explore_every re-plans."""
    policy = SpecPolicy(_costs(1.0, 0.05), MAX_K, explore_every=4)
    planner = RowPlanner(policy, BandPriors(MAX_K))
    planner.add("a", 1.0)
    planner._own["a"] = AcceptanceStats(MAX_K, prior_rates=tuple(LOW), prior_weight=1e9)
    looks = [planner.plan(("a",), [64], lambda i: 0).any_drafting for _ in range(40)]
    assert [i + 1 for i, look in enumerate(looks) if look] == [10, 19, 37]


def test_a_request_kept_plain_by_early_rejections_drafts_again_later() -> None:
    """Rejections met early keep a lone request plain, then fade over its plain steps
    (the planner fades every row that did not draft) until it drafts again."""
    planner = RowPlanner(_policy(forward=1.0, per_token=0.02, drafter=0.8), BandPriors(MAX_K))
    planner.add("r", 0.0)
    planner._own["r"] = AcceptanceStats(
        MAX_K, prior_weight=4.0, prior_rates=(0.6, *[0.8] * (MAX_K - 1))
    )
    for _ in range(6):
        planner.observe(["r"], [0.0], [(MAX_K, 0)])
    assert not planner.plan(("r",), [64], lambda i: 0).any_drafting
    steps = 0
    while not planner.plan(("r",), [64], lambda i: 0).any_drafting:
        planner.observe(["r"], [0.0], [(0, 0)])
        steps += 1
        assert steps < 100
    assert steps >= 8


def test_a_request_is_probed_once_however_far_its_evidence_fades() -> None:
    """Probation counts drafting steps: a sampled request that drafted its two probes and
    then ran plain (its evidence faded) is not probed again at every fade."""
    policy = _policy(forward=1.0, per_token=0.02, drafter=0.8)
    planner = RowPlanner(policy, BandPriors(MAX_K))
    planner.add("s", 1.0)
    planner._own["s"] = AcceptanceStats(MAX_K, prior_rates=tuple(LOW), prior_weight=4.0)
    plan = planner.plan(("s",), [64], lambda i: 0, [200])
    assert plan == StepPlan(PROBE_K, (True,))  # new: probed
    for _ in range(2):
        planner.observe(["s"], [1.0], [(PROBE_K, 0)])
    for _ in range(40):
        planner.observe(["s"], [1.0], [(0, 0)])
    assert planner.plan(("s",), [64], lambda i: 0, [200]) == StepPlan.plain(1)


def test_a_new_request_is_probed_when_the_step_can_afford_it() -> None:
    """A lone new request whose band's prior keeps it plain drafts anyway (PROBE_K) while it
    has many tokens left; with few left, or in a busy batch where every row would wait for
    its drafting forward, it is not probed."""
    policy = _policy(forward=1.0, per_token=0.02, drafter=0.8)
    lone = [RowView(LOW, probation=True, tokens_left=200)]
    plain = StepPlan.plain(1)
    assert probed(policy, plain, lone) == StepPlan(PROBE_K, (True,))
    assert probed(policy, plain, [RowView(LOW, probation=True, tokens_left=5)]) == plain
    assert probed(policy, plain, [RowView(LOW, tokens_left=200)]) == plain  # not new
    busy = [*lone, *[RowView(LOW, tokens_left=200)] * 15]
    assert probed(policy, StepPlan.plain(16), busy) == StepPlan.plain(16)
    # joining a drafting group that runs anyway costs the step little: probed at its K
    group = StepPlan(3, (True, False))
    rows = [RowView(HIGH, tokens_left=200), RowView(LOW, probation=True, tokens_left=200)]
    assert probed(policy, group, rows) == StepPlan(3, (True, True))


def test_exploration_looks_at_every_row_when_the_catch_up_is_cheap() -> None:
    policy = SpecPolicy(_costs(1.0, 0.05), MAX_K, explore_every=4)
    rows = [RowView(HIGH), RowView(LOW)]
    plan = StepPlan(3, (True, False))
    looks = [explored(policy, plan, rows) for _ in range(8)]
    wider = [p for p in looks if p != plan]
    assert len(wider) == 2  # every 4th step
    assert all(p == StepPlan(5, (True, True)) for p in wider)


def test_exploration_skips_plain_rows_whose_catch_up_is_dear() -> None:
    costs = _costs(1.0, 0.05)
    dear = CostModel(costs.batch_sizes, costs.num_drafts, costs.seconds, 1.0)
    policy = SpecPolicy(dear, MAX_K, explore_every=2)
    rows = [RowView(HIGH), RowView(LOW, pending=100)]
    plan = StepPlan(3, (True, False))
    looks = [explored(policy, plan, rows) for _ in range(4)]
    assert StepPlan(5, (True, False)) in looks  # the drafting group alone
    plain = StepPlan.plain(2)
    assert all(explored(policy, plain, rows) == plain for _ in range(20))


def test_a_plain_plan_is_kept_while_its_batch_stays_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Plain steps change no estimate: the planner weighs the rows again only when the
    batch changes, a row's estimates move, or REPLAN_EVERY steps have passed; it asks for
    the rows' pending context only then."""
    planner = RowPlanner(_policy(), BandPriors(MAX_K))
    for key in ("a", "b"):
        planner.add(key, 1.0)
        planner._own[key] = AcceptanceStats(MAX_K, prior_rates=tuple(LOW), prior_weight=1e9)
    asked: list[int] = []

    def plan(keys: tuple[str, ...]) -> StepPlan:
        def pending(i: int) -> int:
            asked.append(i)
            return 0

        return planner.plan(keys, [64] * len(keys), pending)

    assert plan(("a", "b")) == StepPlan.plain(2) and asked == [0, 1]
    for _ in range(REPLAN_EVERY):
        assert plan(("a", "b")) == StepPlan.plain(2)
    assert asked == [0, 1]  # kept
    plan(("a", "b"))
    assert asked == [0, 1, 0, 1]  # REPLAN_EVERY steps: weighed again
    plan(("a",))
    assert asked[-1:] == [0] and len(asked) == 5  # the batch changed
    planner.observe(["a"], [1.0], [(3, 3)])
    plan(("a",))
    assert len(asked) == 6  # its estimates moved


def _weighed_at(planner: RowPlanner, keys: tuple[str, ...], steps: int) -> list[int]:
    """The steps (from 0) at which the planner weighed these rows again."""
    weighed: list[int] = []
    for step in range(steps):
        if planner.kept_plan(keys) is None:
            assert planner.weigh(keys, [64] * len(keys), lambda i: 0) == StepPlan.plain(len(keys))
            weighed.append(step)
        planner.observe_plain(keys)
    return weighed


def test_a_big_batch_that_stays_plain_is_weighed_less_and_less_often() -> None:
    """More than SMALL_BATCH rows weighed plain again keep the next plan twice as long (and
    through twice the change), up to MOST_PATIENCE doublings; a drafting step starts again
    from REPLAN_EVERY, and a small batch keeps REPLAN_EVERY throughout."""
    policy = SpecPolicy(_costs(1.0, 0.05), MAX_K, explore_every=0)
    planner = RowPlanner(policy, BandPriors(MAX_K))
    big = tuple(f"r{i}" for i in range(SMALL_BATCH + 1))
    for key in big:
        planner.add(key, 1.0)
        planner._own[key] = AcceptanceStats(MAX_K, prior_rates=tuple(LOW), prior_weight=1e9)
    gaps = [b - a for a, b in itertools.pairwise(_weighed_at(planner, big, 200))]
    most = (REPLAN_EVERY << MOST_PATIENCE) + 1
    assert gaps[:2] == [REPLAN_EVERY + 1, 2 * REPLAN_EVERY + 1]
    assert max(gaps) == most and gaps[-3:] == [most] * 3  # and no longer
    planner.observe(list(big), [1.0] * len(big), [(3, 0)] + [(0, 0)] * (len(big) - 1))
    again = _weighed_at(planner, big, 30)
    assert again[:2] == [0, REPLAN_EVERY + 1]  # drafting: from REPLAN_EVERY again
    small = big[:SMALL_BATCH]
    weighed = _weighed_at(planner, small, 60)
    assert {b - a for a, b in itertools.pairwise(weighed)} == {REPLAN_EVERY + 1}


def test_a_patient_planner_keeps_a_plain_plan_through_more_change() -> None:
    """At its most patient, a 16-row batch's plain plan stands while fewer than
    16 / (CHURN_SHARE >> MOST_PATIENCE) rows have changed, not 16 / CHURN_SHARE."""
    planner = RowPlanner(SpecPolicy(_costs(1.0, 0.05), MAX_K, explore_every=0), BandPriors(MAX_K))
    for n in range(40):
        planner.add(n, 1.0)
        planner._own[n] = AcceptanceStats(MAX_K, prior_rates=tuple(LOW), prior_weight=1e9)
    _weighed_at(planner, tuple(range(16)), 60)  # weighed plain again and again: patient
    assert planner._kept is not None and planner._kept.patience == MOST_PATIENCE
    tolerated = 16 // (CHURN_SHARE >> MOST_PATIENCE)  # rows replaced (in and out: one row)
    planner.weigh(list(range(16)), [64] * 16, lambda i: 0)  # weighed afresh: its age 0
    for shift in range(1, tolerated):
        assert planner.kept_plan(list(range(shift, 16 + shift))) is not None
    assert planner.kept_plan(list(range(tolerated, 16 + tolerated))) is None


def test_a_big_batch_s_plain_plan_stands_while_few_of_its_rows_change() -> None:
    """A closed loop at 16 rows changes a row every few steps: the kept plain plan stands
    for the new batch while fewer than 16 / CHURN_SHARE rows have changed since it was
    weighed (an arrival and a departure: one row), and no longer."""
    planner = RowPlanner(_policy(), BandPriors(MAX_K))
    asked: list[int] = []
    for n in range(19):
        planner.add(n, 1.0)
        planner._own[n] = AcceptanceStats(MAX_K, prior_rates=tuple(LOW), prior_weight=1e9)

    def plan(keys: range | list[int]) -> StepPlan:
        return planner.plan(list(keys), [64] * len(keys), lambda i: asked.append(i) or 0)

    assert plan(range(16)) == StepPlan.plain(16) and len(asked) == 16
    assert plan(range(1, 17)) == StepPlan.plain(16) and len(asked) == 16  # one row changed
    assert plan(range(2, 17)) == StepPlan.plain(15) and len(asked) == 16  # one and a half
    assert CHURN_SHARE == 8
    assert plan(range(2, 18)) == StepPlan.plain(16) and len(asked) == 32  # two: weighed again
    assert plan([*range(3, 18), 18]) == StepPlan.plain(16) and len(asked) == 32


def test_a_batch_s_plain_steps_fade_its_rows_as_each_row_s_own_fades_would() -> None:
    """observe_plain: a step on which every request decoded plain is one count, applied to
    each request when it is next read or drafts; the estimates are those of a fade per row
    and step. A step that leaves a request out (admitted for prefill) fades only its rows."""
    counted, per_row = (RowPlanner(_policy(), BandPriors(MAX_K)) for _ in range(2))
    keys = ["a", "b", "c"]
    for planner in (counted, per_row):
        for key in keys:
            planner.add(key, 0.0)
        planner.observe(keys, [0.0] * 3, [(MAX_K, 1), (MAX_K, 4), (MAX_K, 0)])
    for step in range(3 * FADE_CHUNK + 1):
        stepping = keys if step % 5 else keys[:2]  # now and then "c" sits a step out
        counted.observe_plain(stepping)
        per_row.observe(stepping, [0.0] * len(stepping), [(0, 0)] * len(stepping))
    counted.observe(["b"], [0.0], [(MAX_K, 2)])  # "b" drafts: its fades first
    per_row.observe(["b"], [0.0], [(MAX_K, 2)])
    for key in keys:
        got, want = counted._estimates(key), per_row._estimates(key)
        assert got.idle == want.idle and got.tried == want.tried
        assert got.rates() == want.rates()
    assert 0.0 < counted._own["a"].tried[0] < 1.0  # its one trial, faded


def test_a_drafting_plan_is_weighed_every_step() -> None:
    planner = RowPlanner(_policy(forward=1.0, per_token=0.001), BandPriors(MAX_K))
    planner.add("g", 0.0)  # a fresh greedy band: the optimistic prior drafts
    asked: list[int] = []
    for _ in range(3):
        plan = planner.plan(("g",), [64], lambda i: asked.append(i) or 0)
        assert plan.any_drafting
    assert asked == [0, 0, 0]
    planner.remove("g")
    assert "g" not in planner._own


def test_a_busy_plain_batch_is_not_looked_at() -> None:
    """A look at every row of a plain batch costs a step at k = 2 over a plain one: worth
    it for a lone request, not for a batch of eight whose wide step costs much more."""
    lone = SpecPolicy(_costs(1.0, 0.05), MAX_K, explore_every=2)
    assert StepPlan(2, (True,)) in [
        explored(lone, StepPlan.plain(1), [RowView(LOW)]) for _ in range(2)
    ]
    busy = SpecPolicy(_costs(1.0, 0.2), MAX_K, explore_every=2)
    rows = [RowView(LOW)] * 8
    assert all(explored(busy, StepPlan.plain(8), rows) == StepPlan.plain(8) for _ in range(20))


def _best_split(policy: SpecPolicy, rows: list[RowView]) -> StepPlan:
    """plan_step's rule without its shortcuts: every split of the rows (ordered by their
    expected tokens at the widest k) at every candidate k, weighed in full."""
    n, ks = len(rows), row_speculation._candidate_ks(policy)
    gains = [cumulative_tokens(r.rates, policy.max_k, r.tokens_left) for r in rows]
    order = sorted(range(n), key=lambda i: -gains[i][-1])
    contexts = [rows[i].context or 0 for i in order]
    plain = policy.curve(n, max(contexts))[0]
    best_score, best = n / plain, StepPlan.plain(n)
    per_position = policy.costs.catch_up_per_position / policy.catch_up_horizon
    for m in range(1, n + 1):
        group = order[:m]
        catch = 0.0
        for i in group:
            catch += rows[i].pending * per_position
        for k in ks:
            seconds = policy.curve(m, max(contexts[:m]))[k] + catch
            if m < n:
                seconds += policy.curve(n - m, max(contexts[m:]))[0]
            least = 1.0 if m < n else min(gains[i][k] for i in group)
            tokens = float(n)
            for i in group:
                tokens += gains[i][k] - 1.0
            score = tokens / seconds
            if (
                seconds <= least * plain * (1.0 + row_speculation.SLOWDOWN)
                and score > (n / plain) * (1.0 + policy.margin)
                and score > best_score
            ):
                best_score = score
                best = StepPlan(k, tuple(i in group for i in range(n)))
    return best


@pytest.mark.parametrize("slowdown", [row_speculation.SLOWDOWN, 0.3, 1.0])
@pytest.mark.parametrize("seed", range(3))
def test_the_plan_is_the_best_split_weighed_in_full(
    seed: int, slowdown: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """plan_step rules splits out by their plain costs before weighing their curves: over
    random batches, cost models (two forwards cheap or dear, contexts either side of the
    grid's, corrected by feedback) and acceptance, its plan is the one weighing every
    split finds. With the bound loosened, splits are taken too."""
    monkeypatch.setattr(row_speculation, "SLOWDOWN", slowdown)
    rng = random.Random(seed)
    plans = []
    for _ in range(60):
        term = ContextTerm(128, rng.uniform(0, 2e-4), rng.uniform(0, 2e-4), rng.uniform(0, 1e-4))
        costs = replace(
            _costs(rng.choice([0.02, 0.3, 1.0]), rng.uniform(0.01, 0.1), rng.uniform(0, 0.5)),
            context=term,
            catch_up_per_position=rng.uniform(0, 0.01),
        )
        policy = SpecPolicy(costs, MAX_K, explore_every=0)
        for b in costs.batch_sizes:
            policy.observe_cost(b, rng.choice(costs.num_drafts), rng.uniform(0.5, 2.0))
        rows = [
            RowView(
                [rng.choice([0.05, 0.6, 0.9, 0.99]) for _ in range(MAX_K)],
                context=rng.randint(10, 400),
                pending=rng.choice([0, 0, 30]),
                tokens_left=rng.choice([0, 3, 40]),
            )
            for _ in range(rng.randint(1, 12))
        ]
        plan = plan_step(policy, rows)
        assert plan == _best_split(policy, rows)
        plans.append(plan)
    kinds = {(p.any_drafting, all(p.drafting)) for p in plans}
    splits = {(True, False)} if slowdown > 0.2 else set()
    assert kinds == {(False, False), (True, True)} | splits  # plain, all drafting, splits


def test_a_probe_no_plan_could_use_is_not_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new greedy request whose band keeps it plain in a batch is probed beside another
    greedy one (as hopeful as a lone request, both would draft), but not beside a sampled
    request that accepts nothing: a block that row accepts nothing of, or a second forward,
    slows it past SLOWDOWN however well the probe goes, so the probe's drafting forward
    would delay both rows for nothing."""
    planner = RowPlanner(_policy(forward=1.0, per_token=0.02, drafter=2.0), BandPriors(MAX_K))
    for key in ("g1", "g2"):  # from a greedy band that accepts 55 %, behind 4 trials
        planner.add(key, 0.0)
        planner._own[key] = AcceptanceStats(MAX_K, prior_rates=(0.55,) * MAX_K, prior_weight=4.0)
    planner.add("old", 1.0)
    for _ in range(20):
        planner.observe(["old"], [1.0], [(MAX_K, 0)])

    def plan(keys: tuple[str, ...]) -> StepPlan:
        planner._kept = None
        return planner.plan(keys, [64] * len(keys), lambda i: 0, [300] * len(keys))

    assert plan(("g1", "g2")) == StepPlan(PROBE_K, (True, True))
    assert plan(("g1", "old")) == StepPlan.plain(2)
    monkeypatch.setattr(RowPlanner, "_could_draft", lambda *args: True)
    assert plan(("g1", "old")) == StepPlan(PROBE_K, (True, False))  # the probe rule alone


REPLAY = Path(__file__).resolve().parents[1] / "fixtures" / "planner_replay.json"


def _replay(
    costs: CostModel,
    fixed_k: int | None,
    seed: int,
    stall: float = 3.0,
    believed: CostModel | None = None,
) -> float:
    """Tokens per modelled second of the fixture's requests served one at a time, four
    rounds after the bench's warm-up (two 4-token requests), drafting as a RowPlanner
    plans (`fixed_k` None) or always `fixed_k`. The planner believes `believed` (None:
    `costs`), and its cost feedback sees each step's modelled seconds with a spread (a
    shared machine: log-normal, sigma 0.3) and the first step at each k `stall` times
    slower (a collection, a neighbour starting)."""
    requests = json.loads(REPLAY.read_text(encoding="utf-8"))["requests"]
    policy = SpecPolicy(believed or costs, MAX_K)
    planner = RowPlanner(policy, BandPriors(MAX_K))
    draw, stalled = random.Random(seed), set()
    served = [(0, 4), (1, 4)] + [(i, 64) for _ in range(4) for i in range(len(requests))]
    seconds = tokens = 0.0
    for n, (i, max_tokens) in enumerate(served):
        accepted, prompt = requests[i]["accepted"], requests[i]["prompt_len"]
        planner.add(n, 0.0)
        done, pending = 1, prompt  # the first token came from prefill
        while done < max_tokens:
            if fixed_k is None:
                lag = [pending]  # the row's drafter context to catch up
                plan = planner.plan([n], [prompt + done], lag.__getitem__, [max_tokens - done])
                k = plan.num_drafts if plan.any_drafting else 0
            else:
                k = fixed_k
            step = costs.curve(1, MAX_K)[k] + (pending * costs.catch_up_per_position if k else 0)
            hit = min(k, accepted[done - 1])
            if fixed_k is None:
                seen = step * draw.lognormvariate(0.0, 0.3) * (1.0 if k in stalled else stall)
                stalled.add(k)
                policy.observe_cost(1, k, seen, prompt + done)
                planner.observe([n], [0.0], [(k, hit)])
            pending = 0 if k else pending + 1
            gained = min(hit + 1, max_tokens - done)
            done += gained
            if n >= 2:  # after the warm-up
                seconds, tokens = seconds + step, tokens + gained
        planner.remove(n)
    return tokens / seconds


@pytest.mark.parametrize("calibration", ["c1-a", "c1-before1", "before-greedy"])
def test_a_lone_request_drafts_as_fixed_k_does_though_step_times_scatter(
    calibration: str,
) -> None:
    """Replayed on recorded acceptance (an answer's first drafts are mostly rejected, its
    later ones mostly accepted) and start-up calibrations of this machine, adaptive keeps
    within 10 % of the best fixed k in every seed, though the step times it learns from
    scatter and stall. Its feedback once took a k's first step as that k's cost: a stalled
    first step priced drafting out: 0.48-0.58x the best fixed k in the worst of these seeds."""
    recorded = json.loads(REPLAY.read_text(encoding="utf-8"))["costs"][calibration]
    costs = CostModel.from_json(recorded)
    best = max(_replay(costs, k, 0) for k in (7, 15))
    for seed in range(4):
        assert _replay(costs, None, seed) >= 0.9 * best, seed


def test_after_a_block_accepted_whole_a_row_plans_by_what_followed_such_blocks() -> None:
    """A row's acceptance comes in stretches: after a block it accepted whole the next one
    mostly is too (here 4 in 5), while over all its steps one block in five is. Planned by
    all its steps, it would decode plain throughout; planned after a whole block by what
    followed its whole blocks, it drafts the whole block there and only there."""
    planner = RowPlanner(_policy(forward=1.0, per_token=0.02, drafter=6.0), BandPriors(MAX_K))
    planner.add("r", 0.0)
    for accepted in ([0] * 20 + [MAX_K] * 5) * 30 + [0] * 20 + [MAX_K]:
        planner.observe(["r"], [0.0], [(MAX_K, accepted)])
    after_whole = planner.plan(["r"], [64], lambda i: 0, [10_000])
    planner.observe(["r"], [0.0], [(MAX_K, 0)])
    after_miss = planner.plan(["r"], [64], lambda i: 0, [10_000])
    assert after_whole == StepPlan(MAX_K, (True,))
    assert after_miss == StepPlan.plain(1)


@pytest.mark.parametrize("calibration", ["c1-a", "c1-before1", "before-greedy"])
def test_a_calibration_slower_than_the_machine_throughout_plans_as_well(calibration: str) -> None:
    """The feedback learns a uniform error of the calibration as the machine's speed, which
    changes no plan. It once kept each draft count's error apart from the overall's, so a
    count seen a few times before the overall had learnt the error was priced that much
    above the rest (and, the curve kept monotone, every count below it too): with the
    calibration 1.3x slower than the steps, the replay read 0.96-0.97x what it read with the
    calibration at the steps' speed, 0.90x the best fixed k in the worst seed."""
    costs = CostModel.from_json(
        json.loads(REPLAY.read_text(encoding="utf-8"))["costs"][calibration]
    )
    slower = replace(costs, seconds=tuple(tuple(1.3 * s for s in row) for row in costs.seconds))
    seeds = range(6)
    right = sum(_replay(costs, None, seed) for seed in seeds)
    assert sum(_replay(costs, None, seed, believed=slower) for seed in seeds) >= 0.99 * right
