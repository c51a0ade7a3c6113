"""Adaptive speculation: cost model interpolation, acceptance estimates, the k choice."""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import pairwise

import pytest

from engine.adaptive import (
    EXPLORE_BACKOFF,
    FADE_CHUNK,
    AcceptanceStats,
    ContextTerm,
    CostFeedback,
    CostModel,
    SpecPolicy,
    calibrate,
    conditional_rates,
    cumulative_tokens,
    default_grid,
    expected_tokens,
    speculative_tokens_per_batch_size,
)


def _linear_costs(plain: float = 1.0, per_token: float = 0.1) -> CostModel:
    """A step costs plain + per_token * (tokens verified beyond one row's first)."""
    bs, ks = (1, 4, 16), (0, 3, 7, 15)
    return CostModel(
        bs, ks, tuple(tuple(plain + per_token * (b * (k + 1) - 1) for k in ks) for b in bs)
    )


def test_cost_interpolates_and_extrapolates_linearly() -> None:
    costs = _linear_costs()
    assert costs.cost(1, 0) == pytest.approx(1.0)
    assert costs.cost(1, 5) == pytest.approx(1.5)  # between k = 3 and 7
    assert costs.cost(8, 3) == pytest.approx(1.0 + 0.1 * 31)  # between b = 4 and 16
    assert costs.cost(32, 0) == pytest.approx(1.0 + 0.1 * 31)  # beyond the grid
    assert costs.relative(1, 15) == pytest.approx(2.5)


def test_bad_grids_are_refused() -> None:
    with pytest.raises(ValueError):
        CostModel((1, 1), (0,), ((1.0,), (1.0,)))
    with pytest.raises(ValueError):
        CostModel((1,), (0, 1), ((1.0,),))
    with pytest.raises(ValueError):
        CostModel((1,), (0,), ((0.0,),))


def test_calibration_measures_every_point_and_irons_out_inversions() -> None:
    seen: list[tuple[int, int]] = []

    def measure(b: int, k: int) -> float:
        seen.append((b, k))
        return 2.0 if (b, k) == (1, 1) else 1.0 + b + k  # (1, 1) measured too slow

    costs = calibrate(measure, [2, 1], [1, 0, 3])
    assert sorted(seen) == [(b, k) for b in (1, 2) for k in (0, 1, 3)]
    assert costs.batch_sizes == (1, 2) and costs.num_drafts == (0, 1, 3)
    assert costs.seconds[0] == (2.0, 3.0, 5.0) or costs.seconds[0][1] >= costs.seconds[0][0]
    for row in costs.seconds:
        assert list(row) == sorted(row)
    for j in range(3):
        assert costs.seconds[0][j] <= costs.seconds[1][j]


def test_default_grid_includes_the_limits() -> None:
    assert default_grid(8, 15) == ([1, 2, 4, 8], [0, 1, 2, 3, 5, 7, 11, 15])
    assert default_grid(3, 4) == ([1, 2, 3], [0, 1, 2, 3, 4])
    assert default_grid(1, 0) == ([1], [0])


def test_expected_tokens() -> None:
    assert expected_tokens([0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1.75)
    assert expected_tokens([1.0] * 15, 15) == 16.0


def test_acceptance_counts_only_the_positions_tried() -> None:
    stats = AcceptanceStats(max_k=4, halflife_steps=1e9, prior_weight=0.0)
    stats.observe([(4, 1), (2, 2)])  # row 1: pos 1 ok, pos 2 rejected; row 2: both ok
    assert stats.tried == pytest.approx([2.0, 2.0, 0.0, 0.0])
    assert stats.accepted == pytest.approx([2.0, 1.0, 0.0, 0.0])
    stats.observe([(0, 0)])  # a plain step tells nothing about drafts
    assert stats.tried == pytest.approx([2.0, 2.0, 0.0, 0.0])


def test_plain_steps_do_not_age_the_estimates() -> None:
    """Forgetting goes by drafting steps: a long plain stretch (a busy server) leaves the
    last estimates in place instead of sliding back to the optimistic prior."""
    stats = AcceptanceStats(max_k=2, halflife_steps=4.0, prior_weight=1.0)
    for _ in range(20):
        stats.observe([(2, 0)])
    before = stats.rates()
    for _ in range(100):
        stats.observe([(0, 0), (0, 0)])
    assert stats.rates() == before and before[0] < 0.2


def test_unexplored_positions_follow_the_one_before_and_old_news_fades() -> None:
    stats = AcceptanceStats(max_k=3, halflife_steps=8.0, prior_rate=0.8, prior_weight=1.0)
    assert stats.rates() == pytest.approx([0.8] * 3)
    for _ in range(40):
        stats.observe([(1, 0)])  # position 1 always rejected
    rates = stats.rates()
    # Never tried, positions 2 and 3 are judged like position 1, not by the optimistic prior.
    assert rates[0] < 0.1 and rates[1:] == pytest.approx([rates[0]] * 2)
    for _ in range(40):
        stats.observe([(3, 3)])  # the deeper ones, once tried, stand on their own
    assert stats.rates()[0] > 0.9 and stats.rates()[2] > 0.9
    for _ in range(40):
        stats.observe([(1, 1)])  # now always accepted: the estimate follows within steps
    assert stats.rates()[0] > 0.9


def test_policy_speculates_when_cheap_and_stops_when_verification_is_costly() -> None:
    high = AcceptanceStats(max_k=15, prior_rate=0.9, prior_weight=1e9)
    low = AcceptanceStats(max_k=15, prior_rate=0.01, prior_weight=1e9)
    policy = SpecPolicy(_linear_costs(per_token=0.02), max_k=15, explore_every=0)
    assert policy.choose(1, high) >= 7
    assert policy.choose(1, low) == 0  # drafts never accepted: plain decoding
    costly = SpecPolicy(_linear_costs(per_token=0.5), max_k=15, explore_every=0)
    assert costly.choose(16, high) == 0  # a 16-row batch: verifying costs too much
    assert SpecPolicy(_linear_costs(), 15, mode="fixed").choose(16, low) == 15


def test_policy_choice_maximises_tokens_per_second() -> None:
    costs = _linear_costs(per_token=0.05)
    stats = AcceptanceStats(max_k=15, prior_rate=0.7, prior_weight=1e9)
    policy = SpecPolicy(costs, 15, explore_every=0, margin=0.0)
    for b in (1, 4, 16):
        k = policy.choose(b, stats)
        best = max(expected_tokens(stats.rates(), j) / costs.cost(b, j) for j in range(16))
        assert expected_tokens(stats.rates(), k) / costs.cost(b, k) == pytest.approx(best)


def test_drafting_must_beat_plain_by_the_margin() -> None:
    """Near break-even the model's error would decide: plain decoding wins ties and
    anything within `margin` of them."""
    costs = _linear_costs(per_token=0.05)
    picks = []
    for rate in (0.05, 0.06, 0.07, 0.08, 0.1, 0.15, 0.2):
        stats = AcceptanceStats(max_k=15, prior_rate=rate, prior_weight=1e9)
        exact = SpecPolicy(costs, 15, explore_every=0, margin=0.0).choose(1, stats)
        gain = expected_tokens(stats.rates(), exact) * costs.cost(1, 0) / costs.cost(1, exact)
        careful = SpecPolicy(costs, 15, explore_every=0).choose(1, stats)
        assert careful == (exact if gain > 1.03 else 0), (rate, gain)
        picks.append((exact, careful))
    assert (1, 0) in picks and (1, 1) in picks  # both sides of the margin were seen


def test_cost_feedback_is_kept_per_batch_size() -> None:
    """Steps of 32 rows over long contexts running dear at k = 15 say nothing of 1 row."""
    stats = AcceptanceStats(max_k=15, prior_rate=0.95, prior_weight=1e9)
    policy = SpecPolicy(_linear_costs(per_token=0.005), 15, explore_every=0)
    for _ in range(30):
        policy.observe_cost(16, 15, 10.0 * policy.costs.cost(16, 15))
        policy.observe_cost(16, 0, policy.costs.cost(16, 0))
    assert policy.cost(16, 15) > 2.0 * policy.costs.cost(16, 15)
    assert policy.cost(1, 15) == policy.costs.cost(1, 15) and policy.choose(1, stats) == 15


def test_exploration_verifies_a_few_more_drafts_now_and_then() -> None:
    """Every `explore_every` steps while drafting pays; from plain, at doubling intervals
    (up to EXPLORE_BACKOFF times) while the looks find drafting still not worth it."""
    rare = AcceptanceStats(max_k=15, prior_rate=0.05, prior_weight=1e9)
    policy = SpecPolicy(_linear_costs(), 15, explore_every=4)
    ks = [policy.choose(1, rare) for _ in range(4 + 8 + 16 + 32 + 32)]
    looks = [i + 1 for i, k in enumerate(ks) if k]
    assert looks == [4, 12, 28, 60, 92] and set(ks) == {0, 2}
    assert EXPLORE_BACKOFF * 4 == 92 - 60
    often = AcceptanceStats(max_k=15, prior_rate=0.6, prior_weight=1e9)
    steady = SpecPolicy(_linear_costs(per_token=0.01), 15, explore_every=4)
    assert [steady.choose(1, often) for _ in range(8)] == [7, 7, 7, 10, 7, 7, 7, 10]


def test_context_put_off_by_plain_steps_is_weighed_before_drafting_again() -> None:
    """Drafting again first projects the context plain steps left out; its cost, spread
    over `catch_up_horizon` steps, can keep a marginal batch plain."""
    base = _linear_costs(per_token=0.02)
    costs = CostModel(base.batch_sizes, base.num_drafts, base.seconds, 1e-3)
    stats = AcceptanceStats(max_k=15, prior_rate=0.5, prior_weight=1e9)
    policy = SpecPolicy(costs, 15, explore_every=0)
    assert policy.choose(4, stats, pending=0) > 0
    assert policy.choose(4, stats, pending=100_000) == 0
    # exploring from plain: only when the catch-up costs little next to a plain step
    low = AcceptanceStats(max_k=15, prior_rate=0.01, prior_weight=1e9)
    explorer = SpecPolicy(costs, 15, explore_every=2)
    assert [explorer.choose(1, low, pending=10_000) for _ in range(4)] == [0, 0, 0, 0]
    assert [explorer.choose(1, low, pending=10) for _ in range(2)] == [2, 0]


def test_vllm_table_shrinks_k_as_the_batch_grows() -> None:
    table = speculative_tokens_per_batch_size(
        _linear_costs(per_token=0.05), [0.8] * 15, [16, 1, 4], 15
    )
    assert list(table) == [1, 4, 16]
    assert table[1] >= table[4] >= table[16]
    assert table[1] > 0


def test_observed_step_times_repair_a_wrong_calibration() -> None:
    """Calibrated: verifying is nearly free, so k = 15. Observed: k = 15 steps take 10x
    the model; the policy backs off. A uniform slowdown alone changes nothing."""
    stats = AcceptanceStats(max_k=15, prior_rate=0.95, prior_weight=1e9)
    policy = SpecPolicy(_linear_costs(per_token=0.005), 15, explore_every=0)
    assert policy.choose(4, stats) == 15
    uniform = SpecPolicy(_linear_costs(per_token=0.005), 15, explore_every=0)
    for k in (0, 15):
        for _ in range(30):
            uniform.observe_cost(4, k, 3.0 * uniform.costs.cost(4, k))
    assert uniform.choose(4, stats) == 15
    for _ in range(30):
        policy.observe_cost(4, 15, 10.0 * policy.costs.cost(4, 15))
        policy.observe_cost(4, 0, policy.costs.cost(4, 0))
    assert policy.cost(4, 15) > 2.0 * policy.costs.cost(4, 15)
    assert policy.choose(4, stats) < 15


def test_one_slow_step_does_not_price_its_k_out() -> None:
    """A stall on a k's first step (another process, a collection) is one step: it must not
    set that k's cost, or the policy never runs the k again to correct it."""
    stats = AcceptanceStats(max_k=15, prior_rate=0.95, prior_weight=1e9)
    policy = SpecPolicy(_linear_costs(per_token=0.005), 15, explore_every=0)
    for _ in range(10):
        policy.observe_cost(1, 0, policy.costs.cost(1, 0))
    policy.observe_cost(1, 15, 5.0 * policy.costs.cost(1, 15))
    assert policy.cost(1, 15) < 1.1 * policy.costs.cost(1, 15)
    assert policy.choose(1, stats) == 15


def test_an_error_every_step_shares_is_learnt_in_full() -> None:
    """Each step moves the feedback by a bounded amount, but a k that always runs 10x its
    model is learnt as 10x, however many steps that takes."""
    feedback = CostFeedback()
    for _ in range(200):
        feedback.observe(15, math.log(10.0), 0.1)
        feedback.observe(0, 0.0, 0.1)
    assert feedback.factors()[15] / feedback.factors()[0] == pytest.approx(10.0, rel=0.02)


def test_the_machine_speeding_up_while_a_k_is_not_run_leaves_that_k_priced_as_before() -> None:
    """A k's error is kept relative to the machine's speed of its time: steps at k = 7 as
    modelled, then the machine a quarter faster at k = 0 alone, leave k = 7 priced as
    modelled relative to k = 0. Kept apart from the overall, k = 7 read 1.33x."""
    feedback = CostFeedback()
    for _ in range(5):
        feedback.observe(7, 0.0, 0.1)
    for _ in range(300):
        feedback.observe(0, math.log(0.75), 0.1)
    assert feedback.overall == pytest.approx(math.log(0.75), rel=0.01)
    assert feedback.factors()[7] / feedback.factors()[0] == pytest.approx(1.0, abs=0.01)


def test_cost_model_json_round_trip_and_counter_rates() -> None:
    costs = _linear_costs()
    assert CostModel.from_json(costs.to_json()) == costs
    measured = CostModel(costs.batch_sizes, costs.num_drafts, costs.seconds, 2e-6)
    assert CostModel.from_json(measured.to_json()) == measured
    assert measured.monotone().catch_up_per_position == 2e-6
    with pytest.raises(ValueError):
        CostModel.from_json({"batch_sizes": [1]})
    assert conditional_rates([80, 40, 0], 100) == pytest.approx([0.8, 0.5, 0.0])
    assert conditional_rates([0, 0], 0) == [0.0, 0.0]


def test_the_context_term_moves_the_grid_with_the_rows_context() -> None:
    # From context 100 to 500 at b=2: plain steps grow by 0.2 s, 1-draft steps by 0.35 s
    # (the drafter's block attends to the longer context too), 3-draft steps by 0.45 s.
    term = ContextTerm.fit(100, 500, 2, 3, plain=(1.0, 1.2), one=(1.5, 1.85), drafting=(2.0, 2.45))
    span = 2 * 400
    assert term.per_query_key == pytest.approx(0.1 / span / 2)
    assert term.per_row_key == pytest.approx(0.2 / span - term.per_query_key)
    assert term.per_drafting_key == pytest.approx(0.15 / span - term.per_query_key)
    assert term.extra(2, 0, 500) == pytest.approx(0.2)
    assert term.extra(2, 1, 500) == pytest.approx(0.35)
    assert term.extra(2, 3, 500) == pytest.approx(0.45)
    costs = replace(_linear_costs(), context=term)
    at_grid = costs.curve(2, 3)
    assert costs.curve(2, 3, context=100) == pytest.approx(at_grid)
    longer = costs.curve(2, 3, context=500)
    assert longer[0] - at_grid[0] == pytest.approx(0.2) and longer[3] > at_grid[3]
    assert min(costs.curve(2, 3, context=-(10**9))) > 0  # never below a quarter of the grid
    assert CostModel.from_json(costs.to_json()) == costs
    # Noise that shrinks a cost with context never makes a slope negative.
    shrunk = ContextTerm.fit(100, 500, 2, 3, (1.0, 0.9), (1.5, 1.4), (2.0, 1.0))
    assert shrunk == ContextTerm(100)


def test_a_request_s_own_evidence_fades_over_its_plain_steps() -> None:
    """fade(): rejections met early weigh less after plain steps, whole FADE_CHUNKs at a
    time, and the estimate moves back toward the prior (halflife_steps plain steps halve
    them, as drafting ones do); a drafting step starts the count again."""
    stats = AcceptanceStats(max_k=2, halflife_steps=8.0, prior_rates=(0.7, 0.7), prior_weight=4.0)
    stats.observe([(2, 0)])
    stats.observe([(2, 0)])
    low, tried = stats.rates()[0], stats.tried[0]
    for _ in range(FADE_CHUNK - 1):
        stats.fade()
    assert stats.rates()[0] == low  # not a whole chunk yet
    for _ in range(8 - FADE_CHUNK + 1):
        stats.fade()
    assert stats.rates()[0] > low  # settled: the counts below are current
    assert stats.tried[0] == pytest.approx(tried / 2)
    for _ in range(200):
        stats.fade()
    assert stats.rates()[0] == pytest.approx(0.7, abs=0.01)
    assert stats.drafted_steps == 2  # fading forgets evidence, not that it drafted
    stats.fade()
    stats.observe([(2, 2)])  # a partial chunk is dropped, not carried over
    assert stats.idle == 0 and stats.drafted_steps == 3


def test_fading_several_plain_steps_at_once_is_fading_each() -> None:
    """fade(n) is n fades: the same counts once read, and the kept estimates dropped
    exactly when a FADE_CHUNK completes within the n steps."""
    one, many = (
        AcceptanceStats(max_k=3, halflife_steps=8.0, prior_rates=(0.7, 0.6, 0.5)) for _ in range(2)
    )
    for stats in (one, many):
        stats.observe([(3, 1)])
    for steps in (1, 2, FADE_CHUNK - 1, FADE_CHUNK, 3 * FADE_CHUNK + 1):
        kept = many.rates()
        for _ in range(steps):
            one.fade()
        many.fade(steps)
        assert many.idle == one.idle
        assert (many.rates() is kept) == (
            one.idle // FADE_CHUNK == (one.idle - steps) // FADE_CHUNK
        )
        assert many.rates() == one.rates() and many.tried == one.tried


def test_optimistic_rates_are_kept_per_doubt_until_the_estimates_move() -> None:
    """A churning batch asks at OPTIMISM over 31 rows, then over 32, and a look at OPTIMISM:
    each doubt's rates are computed once, not again whenever another doubt came between;
    a drafting step moves them all."""
    stats = AcceptanceStats(max_k=4, prior_rates=(0.9, 0.8, 0.7, 0.6))
    stats.observe([(4, 2)])
    asked = {z: stats.optimistic_rates(z) for z in (1 / 31, 1 / 32, 1.0)}
    for _ in range(3):
        for z, first in asked.items():
            assert stats.optimistic_rates(z) is first
    assert asked[1.0][0] > asked[1 / 31][0] > asked[1 / 32][0] > stats.rates()[0]
    stats.observe([(4, 0)])
    for z, first in asked.items():
        moved = stats.optimistic_rates(z)
        assert moved is not first and moved[0] < first[0]


def test_a_request_s_token_curves_are_kept_until_its_estimates_move() -> None:
    """tokens_by_k: cumulative_tokens of the (raised) estimates, cut at the tokens left,
    the same list until a drafting step or a whole chunk of fading moves the counts; a
    request with no evidence of its own has nothing to fade."""
    stats = AcceptanceStats(max_k=4, prior_rates=(0.9, 0.8, 0.7, 0.6))
    point = stats.tokens_by_k(0.0, 100)
    assert point == pytest.approx(cumulative_tokens(stats.rates(), 4))
    assert stats.tokens_by_k(0.0, 100) is point
    raised = stats.tokens_by_k(0.5, 100)
    assert raised == pytest.approx(cumulative_tokens(stats.optimistic_rates(0.5), 4))
    assert raised[-1] > point[-1]
    assert stats.tokens_by_k(0.0, 3) == pytest.approx([*point[:3], point[2], point[2]])
    for _ in range(4 * FADE_CHUNK):  # no evidence yet: fading changes nothing
        stats.fade()
    assert stats.tokens_by_k(0.0, 100) is point
    stats.observe([(4, 0)])
    moved = stats.tokens_by_k(0.0, 100)
    assert moved == pytest.approx(cumulative_tokens(stats.rates(), 4)) and moved[1] < point[1]
    for _ in range(FADE_CHUNK - 1):
        stats.fade()
    assert stats.tokens_by_k(0.0, 100) is moved  # not a whole chunk yet
    stats.fade()
    faded = stats.tokens_by_k(0.0, 100)
    assert faded is not moved and faded[1] > moved[1]


def test_plain_costs_are_each_curve_s_first_cost_and_no_k_costs_less() -> None:
    """plain_costs (the planner's batch of plain costs) agrees with curve()[0] at the
    grid's context, longer and shorter ones, before and after feedback; and a curve moved
    to a short context, where a wider step's cost falls faster, still never makes a wider
    step look cheaper than a narrower one."""
    term = ContextTerm(tokens=500, per_row_key=1e-5, per_query_key=6e-4, per_drafting_key=1e-4)
    policy = SpecPolicy(replace(_linear_costs(plain=10.0), context=term), 15)
    pairs = [(1, None), (4, 500), (3, 900), (16, 300), (7, 0)]

    def firsts() -> list[float]:
        return [policy.curve(b, c)[0] for b, c in pairs]

    assert policy.plain_costs(*zip(*pairs, strict=True)) == firsts()
    assert policy.plain_cost(16, 300) == policy.curve(16, 300)[0]
    raw = policy.costs.curve(16, 15, context=300)
    assert any(a > z for a, z in pairwise(raw))  # the model's own dips
    for b, c in pairs:
        curve = policy.curve(b, c)
        assert all(a <= z for a, z in pairwise(curve))
    for b in (1, 4, 16):
        policy.observe_cost(b, 0, 2.0 * policy.cost(b, 0))
        policy.observe_cost(b, 7, 0.5 * policy.cost(b, 7))
    assert policy.plain_costs(*zip(*pairs, strict=True)) == firsts()
    for b, c in pairs:
        curve = policy.curve(b, c)
        assert all(a <= z for a, z in pairwise(curve))


def test_a_step_as_fast_as_the_model_said_at_its_context_corrects_nothing() -> None:
    """observe_cost reads the model at the step's own context: steps that took what the
    model gives there, at any k, leave every curve as it was."""
    term = ContextTerm(tokens=500, per_row_key=1e-5, per_query_key=6e-4, per_drafting_key=1e-4)
    policy = SpecPolicy(replace(_linear_costs(plain=10.0), context=term), 15)
    before = {(b, c): policy.curve(b, c) for b in (4, 16) for c in (300, 500, 900)}
    for b, c in before:
        for k in (0, 1, 7, 15):
            policy.observe_cost(b, k, policy.costs.curve(b, 15, context=c)[k], c)
    for (b, c), curve in before.items():
        assert policy.curve(b, c) == pytest.approx(curve, rel=1e-12)
