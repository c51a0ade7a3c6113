"""Automatic promotion of a canary pool (docs/gateway.md, "Automatic promotion").

A canary pool (another drafter, another `num_speculative_tokens`) with `promotion:` is
compared with its baseline pool of the same model on live traffic: each request's decode
speed (log tokens/s), by class (temperature band, prompt length), through an always-valid
sequential test (service/routing/sequential.py). The canary's share steps up stage by stage
(10 -> 25 -> 50 -> 100 % by default, the baseline keeping the rest) when it is faster with the
test's confidence, is rolled back to 0 when it is slower, and holds on a tie. Each stage is a
fresh test at the new split: speculation's value moves with load. A canary with failed
requests above `max_error_rate`, or with a worker that fails its health check, is never
promoted. An operator's pin (`PUT /admin/pools/{pool}`) wins over the decisions.

Lossless speculation makes this safe: every pool of a model gives the same output
distribution, so moving traffic changes speed, never answers.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.routing.sequential import Evidence, Moments, compare

log = logging.getLogger("dflash.gateway.promotion")

Decision = Literal["promote", "rollback", "hold"]
DECISIONS: tuple[Decision, ...] = ("promote", "rollback", "hold")
# A prompt this long or longer is "long": the context term of a DFlash step grows with it.
LONG_PROMPT_TOKENS = 512


class PromotionSpec(BaseModel):
    """A pool's `promotion:` in the pools file: the canary side of a comparison."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    baseline: str = Field(min_length=1)  # the pool of the same model it is compared with
    # The canary's share (of 100) at each stage; the baseline has the rest.
    stages: tuple[float, ...] = (10.0, 25.0, 50.0, 100.0)
    # Samples of each pool in a stage before any decision: with per-request speed varying by
    # about 25 %, 50 canary samples tell a 15 % difference (tests/service/routing/
    # test_promotion.py replays it).
    min_samples: int = Field(default=50, ge=1)
    alpha: float = Field(default=0.05, gt=0, lt=0.5)  # the test's error rate
    # The mixing scale of the effect, in log speed (0.2: differences around 20 %).
    effect_scale: float = Field(default=0.2, gt=0, le=5)
    # A canary failing more than this share of its requests (after min_samples) is rolled
    # back; one failing more than its baseline is never promoted.
    max_error_rate: float = Field(default=0.02, ge=0, le=1)

    @model_validator(mode="after")
    def _check_stages(self) -> PromotionSpec:
        if not self.stages:
            raise ValueError("promotion.stages: give at least one stage")
        for share in self.stages:
            if not 0 < share <= 100:
                raise ValueError(f"promotion.stages: {share:g} is not a weight in (0, 100]")
        if list(self.stages) != sorted(set(self.stages)):
            raise ValueError("promotion.stages must increase")
        if self.stages[-1] != 100:
            raise ValueError("promotion.stages must end at 100 (the canary fully promoted)")
        return self


def request_class(temperature: float | None, prompt_tokens: int) -> str:
    """The class a request's speed is compared within."""
    band = "greedy" if temperature == 0 else "sampled"
    size = "long" if prompt_tokens >= LONG_PROMPT_TOKENS else "short"
    return f"{band}/{size}"


Status = Literal["testing", "promoted", "rolled_back"]


@dataclass
class Tally:
    """One stage's evidence: log speeds by pool and class, acceptance, requests, failures."""

    speeds: dict[str, dict[str, Moments]] = field(default_factory=dict)  # pool -> class ->
    acceptance: dict[str, Moments] = field(default_factory=dict)  # pool ->
    requests: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)

    def record(self, pool: str, klass: str, speed: float | None, acceptance: float | None) -> None:
        self.requests[pool] = self.requests.get(pool, 0) + 1
        if speed is not None and speed > 0 and math.isfinite(speed):
            self.speeds.setdefault(pool, {}).setdefault(klass, Moments()).add(math.log(speed))
        if acceptance is not None and math.isfinite(acceptance):
            self.acceptance.setdefault(pool, Moments()).add(acceptance)

    def fail(self, pool: str) -> None:
        self.errors[pool] = self.errors.get(pool, 0) + 1

    def fields(self) -> dict[str, float]:
        """Flat `pool<TAB>what` counters, summable across gateway replicas (promotion_store)."""
        flat: dict[str, float] = {}
        for pool, classes in self.speeds.items():
            for klass, m in classes.items():
                flat.update(moment_fields(f"{pool}\tspeed\t{klass}", m))
        for pool, m in self.acceptance.items():
            flat.update(moment_fields(f"{pool}\tacceptance\t", m))
        flat.update({f"{pool}\trequests": float(n) for pool, n in self.requests.items()})
        flat.update({f"{pool}\terrors": float(n) for pool, n in self.errors.items()})
        return flat

    @classmethod
    def from_fields(cls, flat: Mapping[str, float]) -> Tally:
        """The tally `fields` wrote (summed); unknown names are skipped."""
        tally = cls()
        for name, value in flat.items():
            parts = name.split("\t")
            if len(parts) == 2 and parts[1] in ("requests", "errors"):
                getattr(tally, parts[1])[parts[0]] = int(value)
            elif len(parts) == 4 and parts[1] in ("speed", "acceptance"):
                pool, what, klass, part = parts
                if what == "speed":
                    moments = tally.speeds.setdefault(pool, {}).setdefault(klass, Moments())
                else:
                    moments = tally.acceptance.setdefault(pool, Moments())
                if part == "n":
                    moments.n = int(value)
                elif part == "sum":
                    moments.total = value
                elif part == "squares":
                    moments.squares = value
        return tally


def moment_fields(prefix: str, m: Moments) -> dict[str, float]:
    return {f"{prefix}\tn": float(m.n), f"{prefix}\tsum": m.total, f"{prefix}\tsquares": m.squares}


@dataclass
class Rollout:
    """One canary against its baseline: the stage reached and this stage's evidence."""

    model: str
    canary: str
    baseline: str
    spec: PromotionSpec
    stage: int = 0
    status: Status = "testing"
    tally: Tally = field(default_factory=Tally)
    decisions: list[dict[str, Any]] = field(default_factory=list)  # the last few, newest last

    @property
    def speeds(self) -> dict[str, dict[str, Moments]]:
        return self.tally.speeds

    @property
    def acceptance(self) -> dict[str, Moments]:
        return self.tally.acceptance

    @property
    def requests(self) -> dict[str, int]:
        return self.tally.requests

    @property
    def errors(self) -> dict[str, int]:
        return self.tally.errors

    @property
    def canary_share(self) -> float:
        if self.status == "rolled_back":
            return 0.0
        return self.spec.stages[self.stage]

    def weights(self) -> dict[str, float]:
        share = self.canary_share
        return {self.canary: share, self.baseline: 100.0 - share}

    def evidence(self) -> Evidence:
        return compare(
            self.speeds.get(self.canary, {}),
            self.speeds.get(self.baseline, {}),
            self.spec.effect_scale,
        )

    def error_rate(self, pool: str) -> float:
        done = self.requests.get(pool, 0) + self.errors.get(pool, 0)
        return self.errors.get(pool, 0) / done if done else 0.0

    def moved(self, decision: Decision) -> tuple[int, Status]:
        """The stage and status a decision leads to."""
        if decision == "rollback":
            return self.stage, "rolled_back"
        stage = self.stage + 1
        # All of the traffic at the last stage: nothing left to compare.
        return stage, "promoted" if stage == len(self.spec.stages) - 1 else "testing"


def decide(rollout: Rollout, healthy: bool) -> tuple[Decision, Evidence]:
    """The next move of a rollout in testing, and the evidence it rests on."""
    spec = rollout.spec
    evidence = rollout.evidence()
    if rollout.error_rate(rollout.canary) > spec.max_error_rate and (
        rollout.requests.get(rollout.canary, 0) + rollout.errors.get(rollout.canary, 0)
        >= spec.min_samples
    ):
        return "rollback", evidence
    if min(evidence.canary_samples, evidence.baseline_samples) < spec.min_samples:
        return "hold", evidence
    if not evidence.significant(spec.alpha):
        return "hold", evidence
    if evidence.theta < 0:
        return "rollback", evidence
    if not healthy or rollout.error_rate(rollout.canary) > rollout.error_rate(rollout.baseline):
        return "hold", evidence  # faster, but not while it fails more, or fails its checks
    return "promote", evidence


Apply = Callable[[dict[str, float]], None]  # new weights of some pools


class Promotions:
    """Every rollout of the gateway; the fleet feeds it requests and applies its weights."""

    KEEP_DECISIONS = 20

    def __init__(
        self,
        rollouts: list[Rollout],
        base_weights: dict[str, float],
        apply: Apply,
        healthy: Callable[[str], bool],
        count: Callable[[Rollout, Decision], None],  # a decision, for the canary's series
    ) -> None:
        self.rollouts = {r.canary: r for r in rollouts}
        self._base_weights = base_weights  # every pool's configured weight (pins fall back)
        # With a shared store, a pin is written there too (every replica routes by it).
        self.share_pin: Callable[[str, float | None], Awaitable[None]] | None = None
        self._by_pool = {pool: r for r in rollouts for pool in (r.canary, r.baseline)}
        self._apply, self.healthy, self._count = apply, healthy, count
        self.pins: dict[str, float] = {}
        # With a shared store: evidence not yet handed over, by canary; decisions are then
        # taken at the store's sync (one replica takes each), not here on every request.
        self.pending: dict[str, Tally] | None = None
        for rollout in rollouts:
            apply(rollout.weights())

    def observe(self, pool: str, klass: str, speed: float | None, acceptance: float | None) -> None:
        """One request served by `pool`: its decode speed (tokens/s) and acceptance."""
        rollout = self._by_pool.get(pool)
        if rollout is None or rollout.status != "testing":
            return
        self._tally(rollout).record(pool, klass, speed, acceptance)
        if self.pending is None:
            self.step(rollout)

    def failed(self, pool: str) -> None:
        rollout = self._by_pool.get(pool)
        if rollout is not None and rollout.status == "testing":
            self._tally(rollout).fail(pool)
            if self.pending is None:
                self.step(rollout)

    def _tally(self, rollout: Rollout) -> Tally:
        """Where a request's evidence goes: the rollout's own, or with a shared store
        (service/routing/promotion_store.py) what this process has not handed over yet."""
        if self.pending is None:
            return rollout.tally
        return self.pending.setdefault(rollout.canary, Tally())

    def step(self, rollout: Rollout) -> None:
        """Decide on the rollout's evidence, and act on a promotion or rollback."""
        decision, evidence = decide(rollout, self.healthy(rollout.canary))
        if decision != "hold":
            self.move(rollout, decision, evidence, *rollout.moved(decision))

    def record(
        self, rollout: Rollout, decision: Decision, evidence: Evidence, stage: int, status: Status
    ) -> dict[str, Any]:
        """A decision as logged, counted and shown in /admin/pools, with its evidence."""
        after = 0.0 if status == "rolled_back" else rollout.spec.stages[stage]
        card = evidence_card(evidence, rollout)
        return {
            "time": time.time(),
            "decision": decision,
            "from": rollout.canary_share,
            "to": after,
            **card,
        }

    def move(
        self,
        rollout: Rollout,
        decision: Decision,
        evidence: Evidence,
        stage: int,
        status: Status,
        record: dict[str, Any] | None = None,
    ) -> None:
        """Take a decision: log it with its evidence, count it, apply its weights."""
        record = record or self.record(rollout, decision, evidence, stage, status)
        log.warning(
            "promotion: %s canary %s of %s against %s: %g%% -> %g%% (%s)",
            decision,
            rollout.canary,
            rollout.model,
            rollout.baseline,
            record["from"],
            record["to"],
            ", ".join(f"{k}={v}" for k, v in record.items() if k not in ("time", "decision")),
        )
        self._count(rollout, decision)
        rollout.stage, rollout.status = stage, status
        rollout.decisions = [*rollout.decisions, record][-self.KEEP_DECISIONS :]
        rollout.tally = Tally()
        self._publish(rollout)

    def adopt(self, rollout: Rollout, stage: int, status: Status) -> None:
        """Another replica's decision (read from the shared store): its stage and weights."""
        if (stage, status) != (rollout.stage, rollout.status):
            rollout.stage, rollout.status = stage, status
            self._publish(rollout)

    def _publish(self, rollout: Rollout) -> None:
        weights = rollout.weights()
        self._apply({pool: self.pins.get(pool, weight) for pool, weight in weights.items()})

    def pin(self, pool: str, weight: float | None) -> None:
        """An operator's weight for a pool (None: unpinned); it wins over the decisions."""
        if weight is None:
            self.pins.pop(pool, None)
        else:
            self.pins[pool] = weight
        rollout = self._by_pool.get(pool)
        if rollout is not None:
            self._publish(rollout)
        else:
            self._apply({pool: self._base_weights[pool] if weight is None else weight})

    async def set_pin(self, pool: str, weight: float | None) -> None:
        """`pin`, and with a shared store, for every replica."""
        if self.share_pin is not None:
            await self.share_pin(pool, weight)
        self.pin(pool, weight)


def evidence_card(evidence: Evidence, rollout: Rollout) -> dict[str, Any]:
    """What a decision rests on, for the log and /admin/pools."""

    def mean(pool: str) -> float | None:
        moments = rollout.acceptance.get(pool)
        return round(moments.mean, 3) if moments is not None and moments.n else None

    return {
        "speedup": round(math.exp(evidence.theta), 4),
        "log_likelihood_ratio": round(evidence.log_ratio, 3),
        "threshold": round(math.log(1 / rollout.spec.alpha), 3),
        "canary_samples": evidence.canary_samples,
        "baseline_samples": evidence.baseline_samples,
        "canary_acceptance": mean(rollout.canary),
        "baseline_acceptance": mean(rollout.baseline),
        "canary_error_rate": round(rollout.error_rate(rollout.canary), 4),
        "baseline_error_rate": round(rollout.error_rate(rollout.baseline), 4),
    }


def rollouts_of(specs: Mapping[str, Any]) -> list[Rollout]:
    """The rollouts the pools configure (PoolSpecs with an enabled `promotion`)."""
    found = []
    for spec in specs.values():
        promotion: PromotionSpec | None = spec.promotion
        if promotion is not None and promotion.enabled:
            found.append(Rollout(spec.model or "", spec.name, promotion.baseline, promotion))
    return found
