"""An always-valid comparison of two pools' speeds: a mixture sequential probability ratio test
(mSPRT) on the difference of their mean log decode speed, stratified by request class.

Why this test: the gateway looks after every request, and a fixed-sample test checked that
often would promote a pool no better than its baseline far more often than its stated error
rate. The mixture SPRT (Robbins 1970; Johari, Pekelis and Walsh, "Always valid inference",
2017) stays valid under continuous monitoring: with a normal mixing distribution N(0, tau^2)
over the effect theta, the likelihood ratio after any number of samples is

    Lambda = sqrt(V / (V + tau^2)) * exp(tau^2 * theta_hat^2 / (2 V (V + tau^2)))

where theta_hat is the estimated difference and V its variance; the chance that Lambda ever
reaches 1/alpha when theta = 0 is at most alpha. Log speed makes theta a relative difference
(0.1: about 10 % faster) whatever a model's absolute speed. Stratifying by class (temperature
band, prompt length) compares like with like: each class's difference is weighted by its
share of the traffic, so a pool that happened to get more of a slow class is not penalised.

Free functions and plain data: the decision logic (service/routing/promotion.py) replays
recorded traces through them in unit tests.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

# A class needs this many samples on each side before it counts (a variance from one sample
# is undefined).
MIN_CLASS_SAMPLES = 2
# The smallest variance of log speed a class is taken to have: identical samples (a stub, a
# replay) would otherwise give V = 0 and an infinite likelihood ratio.
VARIANCE_FLOOR = 1e-6


@dataclass
class Moments:
    """Running count, sum and sum of squares of one pool's samples in one class."""

    n: int = 0
    total: float = 0.0
    squares: float = 0.0

    def add(self, value: float) -> None:
        self.n += 1
        self.total += value
        self.squares += value * value

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0

    @property
    def variance(self) -> float:
        """Unbiased sample variance, floored."""
        if self.n < 2:
            return VARIANCE_FLOOR
        spread = (self.squares - self.total * self.total / self.n) / (self.n - 1)
        return max(spread, VARIANCE_FLOOR)


@dataclass(frozen=True)
class Evidence:
    """Where the comparison stands: the estimated difference (canary minus baseline, in log
    speed), its variance, the log likelihood ratio, and the samples it rests on."""

    theta: float
    variance: float
    log_ratio: float
    canary_samples: int
    baseline_samples: int

    def significant(self, alpha: float) -> bool:
        return self.log_ratio >= math.log(1.0 / alpha)


def compare(canary: Mapping[str, Moments], baseline: Mapping[str, Moments], tau: float) -> Evidence:
    """The stratified mSPRT over the classes both pools have enough samples of."""
    shared = [
        key
        for key in canary
        if key in baseline
        and canary[key].n >= MIN_CLASS_SAMPLES
        and baseline[key].n >= MIN_CLASS_SAMPLES
    ]
    canary_n = sum(m.n for m in canary.values())
    baseline_n = sum(m.n for m in baseline.values())
    if not shared:
        return Evidence(0.0, math.inf, 0.0, canary_n, baseline_n)
    counts = {key: canary[key].n + baseline[key].n for key in shared}
    everything = sum(counts.values())
    theta = variance = 0.0
    for key in shared:
        weight = counts[key] / everything
        c, b = canary[key], baseline[key]
        theta += weight * (c.mean - b.mean)
        variance += weight * weight * (c.variance / c.n + b.variance / b.n)
    return Evidence(theta, variance, mixture_log_ratio(theta, variance, tau), canary_n, baseline_n)


def mixture_log_ratio(theta: float, variance: float, tau: float) -> float:
    """log Lambda of the normal-mixture SPRT for an estimate `theta` of variance `variance`."""
    tau2 = tau * tau
    spread = variance + tau2
    return 0.5 * math.log(variance / spread) + tau2 * theta * theta / (2.0 * variance * spread)
