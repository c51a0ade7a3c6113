"""The mixture SPRT: its likelihood ratio against a direct integration, stratification, and
the floor that keeps identical samples finite."""

from __future__ import annotations

import math

import pytest

from service.routing.sequential import VARIANCE_FLOOR, Moments, compare, mixture_log_ratio


def moments(*values: float) -> Moments:
    m = Moments()
    for value in values:
        m.add(value)
    return m


def test_moments_mean_and_unbiased_variance() -> None:
    m = moments(1.0, 2.0, 3.0, 4.0)
    assert m.mean == 2.5 and m.variance == pytest.approx(5 / 3)
    assert moments(7.0).variance == VARIANCE_FLOOR and moments(2.0, 2.0).variance == VARIANCE_FLOOR


@pytest.mark.parametrize(
    "theta, variance, tau", [(0.0, 0.01, 0.2), (0.05, 0.001, 0.2), (-0.3, 0.02, 0.5)]
)
def test_the_closed_form_is_the_normal_mixture_of_likelihood_ratios(
    theta: float, variance: float, tau: float
) -> None:
    """Lambda = integral over effect d ~ N(0, tau^2) of N(theta; d, V) / N(theta; 0, V)."""
    steps = 20001
    width = 12 * tau
    total = 0.0
    for i in range(steps):
        d = -width / 2 + width * i / (steps - 1)
        prior = math.exp(-d * d / (2 * tau * tau)) / math.sqrt(2 * math.pi * tau * tau)
        ratio = math.exp((2 * theta * d - d * d) / (2 * variance))
        total += prior * ratio * width / (steps - 1)
    assert mixture_log_ratio(theta, variance, tau) == pytest.approx(
        math.log(total), rel=1e-4, abs=1e-6
    )


def test_no_shared_class_is_no_evidence() -> None:
    evidence = compare(
        {"greedy/short": moments(1.0, 1.1)}, {"sampled/short": moments(1.0, 1.2)}, 0.2
    )
    assert evidence.log_ratio == 0.0 and not evidence.significant(0.05)
    assert (evidence.canary_samples, evidence.baseline_samples) == (2, 2)


def test_classes_are_compared_within_and_weighted_by_their_share() -> None:
    # The canary is 10 % faster in both classes but saw mostly the slow class: unstratified
    # means would call it slower.
    canary = {
        "greedy": moments(*[math.log(110)] * 10 + [math.log(111)] * 10),
        "sampled": moments(*[math.log(55)] * 90 + [math.log(56)] * 90),
    }
    baseline = {
        "greedy": moments(*[math.log(100)] * 90 + [math.log(101)] * 90),
        "sampled": moments(*[math.log(50)] * 10 + [math.log(51)] * 10),
    }
    evidence = compare(canary, baseline, 0.2)
    assert math.exp(evidence.theta) == pytest.approx(1.10, abs=0.01)
    assert evidence.significant(0.05)
