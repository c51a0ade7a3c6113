"""A small resumable training loop shared by the target and drafter stages.

State (model, optimizer, step) is saved atomically every `ckpt_every` steps; a restarted
run continues from the last checkpoint. Batches are drawn from a generator seeded by the
step number, so a resumed run sees the same batches as an uninterrupted one.
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


def lr_at(step: int, cfg: LoopConfig) -> float:
    """Linear warmup, then cosine decay to `min_lr_ratio * lr`."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
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


def _save(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    tmp.replace(path)


def _resume(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    if not path.exists():
        return 0
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return int(state["step"])


# step_fn(step, generator) -> (loss to backprop, metrics to log)
StepFn = Callable[[int, torch.Generator], tuple[torch.Tensor, dict[str, float]]]


def train_loop(
    model: torch.nn.Module,
    step_fn: StepFn,
    cfg: LoopConfig,
    run_dir: Path,
    name: str,
    deadline: float | None = None,
) -> int:
    """Train `model` for `cfg.steps` steps, resuming from `run_dir/ckpt.pt` if present.
    With a `deadline` (time.monotonic()), stop at the first step boundary past it, saving a
    checkpoint there (a rerun goes on from it). Returns the steps done, resumed ones included."""
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt, log_path = run_dir / "ckpt.pt", run_dir / "log.jsonl"
    opt = make_optimizer(model, cfg)
    start = _resume(ckpt, model, opt)
    model.train(True)
    bar = tqdm(range(start, cfg.steps), desc=name, initial=start, total=cfg.steps)
    done = start
    with log_path.open("a", encoding="utf-8") as log:
        t0 = time.monotonic()
        for step in bar:
            if deadline is not None and time.monotonic() >= deadline:
                if step > start:  # (nothing new to save when no step ran)
                    _save(ckpt, model, opt, step)
                break
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
            loss, metrics = step_fn(step, gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            bar.set_postfix(loss=f"{metrics['loss']:.3f}")
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                row = {"step": step, "lr": lr_at(step, cfg), "s": time.monotonic() - t0, **metrics}
                log.write(json.dumps(row) + "\n")
                log.flush()
            if (step + 1) % cfg.ckpt_every == 0 or step == cfg.steps - 1:
                _save(ckpt, model, opt, step + 1)
            done = step + 1
    bar.close()
    model.train(False)
    return done
