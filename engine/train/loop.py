"""A small resumable training loop shared by the target and drafter stages.

State (model, optimizer, step, seconds trained) is saved atomically every `ckpt_every` steps;
a restarted run continues from the last checkpoint. Batches are drawn from a generator seeded
by the step number, so a resumed run sees the same batches as an uninterrupted one.

A run bounded by time (`LoopConfig.seconds`, `dflash-train adapt --minutes`) decays its
learning rate over that time, not over a step count it will never reach: with the cosine
spanning `--steps 100000`, a 15-minute adapt ran ~1600 steps at a constant rate and lost
recipe tau (0.89x, loadtest/RESULTS.md).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm


@dataclass(frozen=True)
class LoopConfig:
    steps: int
    lr: float
    warmup: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    ckpt_every: int = 50
    log_every: int = 10
    seed: int = 0
    # Training-time budget over every resumption of the run (None: steps only). The run stops
    # at the first step boundary past it, and the cosine ends there when it comes first.
    seconds: float | None = None


def lr_at(step: int, cfg: LoopConfig, trained_s: float = 0.0) -> float:
    """Linear warmup, then cosine decay to `min_lr_ratio * lr`, over the steps or over the
    time budget (`trained_s` of `cfg.seconds` spent), whichever is further along."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    if cfg.seconds is not None:
        progress = max(progress, trained_s / cfg.seconds)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def make_optimizer(model: torch.nn.Module, cfg: LoopConfig) -> torch.optim.AdamW:
    # No weight decay on norms (1-d weights), as usual for transformers.
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def _save(
    path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, trained_s: float
) -> None:
    tmp = path.with_suffix(".tmp")
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
    torch.save({**state, "seconds": trained_s}, tmp)
    tmp.replace(path)


def _resume(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[int, float]:
    """(steps done, seconds trained) from the checkpoint; (0, 0.0) without one."""
    if not path.exists():
        return 0, 0.0
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return int(state["step"]), float(state.get("seconds", 0.0))


# step_fn(step, generator) -> (loss to backprop, metrics to log)
StepFn = Callable[[int, torch.Generator], tuple[torch.Tensor, dict[str, float]]]


def train_loop(
    model: torch.nn.Module,
    step_fn: StepFn,
    cfg: LoopConfig,
    run_dir: Path,
    name: str,
) -> int:
    """Train `model` for `cfg.steps` steps, resuming from `run_dir/ckpt.pt` if present.
    With `cfg.seconds`, stop at the first step boundary past that much training (this call's
    and the resumed runs'), saving a checkpoint there. Returns the steps done, resumed ones
    included."""
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt, log_path = run_dir / "ckpt.pt", run_dir / "log.jsonl"
    opt = make_optimizer(model, cfg)
    start, trained_before = _resume(ckpt, model, opt)
    model.train(True)
    bar = tqdm(range(start, cfg.steps), desc=name, initial=start, total=cfg.steps)
    done = start
    with log_path.open("a", encoding="utf-8") as log:
        t0 = time.monotonic()

        def trained_s() -> float:
            return trained_before + time.monotonic() - t0

        for step in bar:
            if cfg.seconds is not None and trained_s() >= cfg.seconds:
                if step > start:  # (nothing new to save when no step ran)
                    _save(ckpt, model, opt, step, trained_s())
                break
            lr = lr_at(step, cfg, trained_s())
            for group in opt.param_groups:
                group["lr"] = lr
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
            loss, metrics = step_fn(step, gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            bar.set_postfix(loss=f"{metrics['loss']:.3f}")
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                row = {"step": step, "lr": lr, "s": time.monotonic() - t0, **metrics}
                log.write(json.dumps(row) + "\n")
                log.flush()
            if (step + 1) % cfg.ckpt_every == 0 or step == cfg.steps - 1:
                _save(ckpt, model, opt, step + 1, trained_s())
            done = step + 1
    bar.close()
    model.train(False)
    return done
