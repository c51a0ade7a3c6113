"""Dispatch of the torch stages of the recipe (target, distill, drafter, eval)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import TYPE_CHECKING

import torch

from engine.train.corpus import CorpusConfig
from engine.train.loop import LoopConfig

if TYPE_CHECKING:
    from engine.train.drafter_training import DrafterTrainConfig


def _with_steps(loop: LoopConfig, steps: int | None) -> LoopConfig:
    return loop if steps is None else dataclasses.replace(loop, steps=steps)


def _target(corpus: CorpusConfig, args: argparse.Namespace) -> None:
    from engine.train.target import TargetRecipe, train_target

    cfg = TargetRecipe.smoke() if args.smoke else TargetRecipe()
    cfg = dataclasses.replace(cfg, loop=_with_steps(cfg.loop, args.steps))
    train_target(corpus, args.out_dir / "target", args.runs_dir / "target", cfg)


def _drafter_config(args: argparse.Namespace) -> DrafterTrainConfig:
    from engine.train.drafter_training import DrafterTrainConfig

    if not args.smoke:
        cfg = DrafterTrainConfig()
    else:
        config = args.out_dir / "target" / "config.json"
        if not config.exists():
            raise FileNotFoundError(f"no target at {config.parent}: run `dflash-train target`")
        cfg = DrafterTrainConfig.smoke(int(json.loads(config.read_text())["num_hidden_layers"]))
    if args.target_layer_ids is not None:
        cfg = dataclasses.replace(cfg, target_layer_ids=args.target_layer_ids)
    if args.arch == "dflash2":
        from engine.train.dflash2_training import RECIPE_DFLASH2, SMOKE_DFLASH2

        cfg = dataclasses.replace(cfg, dflash2=SMOKE_DFLASH2 if args.smoke else RECIPE_DFLASH2)
    return cfg


def drafter_dir(args: argparse.Namespace) -> str:
    """--drafter-dir, or the architecture's own folder (dflash, dflash2)."""
    return str(args.drafter_dir or args.arch)


def _distill(corpus: CorpusConfig, args: argparse.Namespace) -> None:
    from engine.train.distill import DistillConfig, run_distill

    cfg = DistillConfig.smoke() if args.smoke else DistillConfig()
    layer_ids = list(_drafter_config(args).target_layer_ids)
    run_distill(corpus, args.out_dir / "target", args.runs_dir / "distill", cfg, layer_ids)


def _drafter(args: argparse.Namespace) -> None:
    from engine.train.distill import DistillConfig, load_distill
    from engine.train.drafter_training import train_drafter
    from engine.train.tokenizer_recipe import ENDOFTEXT, IM_END, load_tokenizer, token_id

    target_dir = args.out_dir / "target"
    tok = load_tokenizer(target_dir)
    stops = [token_id(tok, IM_END), token_id(tok, ENDOFTEXT)]
    distill = DistillConfig.smoke() if args.smoke else DistillConfig()
    cfg = _drafter_config(args)
    layer_ids = list(cfg.target_layer_ids)
    data = load_distill(args.runs_dir / "distill", distill.prompt_len, stops, layer_ids)
    cfg = dataclasses.replace(cfg, loop=_with_steps(cfg.loop, args.steps))
    # DFlash keeps the recipe's original run folder; DFlash2 gets its own (no cross-resume).
    run_dir = args.runs_dir / ("drafter" if args.arch == "dflash" else f"drafter-{args.arch}")
    train_drafter(target_dir, data, args.out_dir / drafter_dir(args), run_dir, cfg)


def _eval(corpus: CorpusConfig, args: argparse.Namespace) -> None:
    from engine.train.evaluate import EvalConfig, run_eval

    cfg = EvalConfig(num_prompts=2, max_new_tokens=8) if args.smoke else EvalConfig()
    cfg = dataclasses.replace(cfg, temperatures=tuple(args.eval_temperature))
    report = args.runs_dir / ("eval.json" if args.arch == "dflash" else f"eval-{args.arch}.json")
    run_eval(corpus, args.out_dir, drafter_dir(args), report, cfg)


def run_torch_stage(stage: str, corpus: CorpusConfig, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    if stage == "target":
        _target(corpus, args)
    elif stage == "distill":
        _distill(corpus, args)
    elif stage == "drafter":
        _drafter(args)
    elif stage == "eval":
        _eval(corpus, args)
    else:
        raise ValueError(f"unknown stage {stage!r}")
