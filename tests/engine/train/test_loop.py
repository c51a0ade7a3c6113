"""The training loop's schedule and its time budget (engine/train/loop.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from engine.train import loop
from engine.train.loop import LoopConfig, lr_at, train_loop


def test_a_time_budget_decays_the_rate_over_the_time_not_the_steps() -> None:
    cfg = LoopConfig(steps=100_000, lr=1.0, warmup=10, min_lr_ratio=0.1, seconds=600.0)
    assert lr_at(5, cfg, 0.0) == pytest.approx(0.6)  # warmup is by steps
    assert lr_at(500, cfg, 0.0) == pytest.approx(1.0, abs=1e-4)  # no time spent: the top
    assert lr_at(500, cfg, 300.0) == pytest.approx(0.55)  # half the budget: half-way down
    assert lr_at(500, cfg, 600.0) == pytest.approx(0.1)  # spent: the floor
    assert lr_at(500, cfg, 900.0) == pytest.approx(0.1)
    steps_only = LoopConfig(steps=1010, lr=1.0, warmup=10)
    assert lr_at(510, steps_only, 1e9) == pytest.approx(0.55)  # no budget: time is ignored
    # Whichever ends first: the steps are further along than the time here.
    both = LoopConfig(steps=1010, lr=1.0, warmup=10, seconds=1e6)
    assert lr_at(1010, both, 1.0) == pytest.approx(0.1)


def _fit(tmp: Path, cfg: LoopConfig, clock: list[float]) -> tuple[int, list[float]]:
    """Train a linear model; each step takes one second of `clock`. (steps done, the rate
    of each step run)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    rates: list[float] = []

    def step_fn(step: int, gen: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        clock[0] += 1.0
        x = torch.randn(8, 4, generator=gen)
        loss = model(x).pow(2).mean()
        return loss, {"loss": float(loss.detach())}

    done = train_loop(model, step_fn, cfg, tmp, "test")
    for line in (tmp / "log.jsonl").read_text().splitlines()[-(done):]:
        rates.append(json.loads(line)["lr"])
    return done, rates


def test_the_budget_stops_the_run_and_a_resumed_run_gets_only_what_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(loop.time, "monotonic", lambda: clock[0])
    cfg = LoopConfig(steps=10_000, lr=1.0, warmup=1, ckpt_every=1000, log_every=1, seconds=40.0)
    done, rates = _fit(tmp_path, cfg, clock)
    assert done == 40  # stopped by the 40 s, far before 10,000 steps
    assert rates == sorted(rates, reverse=True) and len(set(rates)) == 40
    assert rates[-1] == pytest.approx(lr_at(39, cfg, 39.0)) and rates[-1] < 0.11
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert state["step"] == 40 and state["seconds"] == 40.0
    # Same budget again: nothing is left, no step runs.
    assert _fit(tmp_path, cfg, clock)[0] == 40
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 40
    # A larger budget goes on from the saved time, at the rate where the longer run would be.
    longer = dataclasses.replace(cfg, seconds=80.0)
    more, _ = _fit(tmp_path, longer, clock)
    assert more == 80
    logged = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert logged[40]["step"] == 40 and logged[40]["lr"] == pytest.approx(lr_at(40, longer, 40.0))
    assert logged[40]["lr"] == pytest.approx(0.55)
