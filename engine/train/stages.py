"""Dispatch of the torch stages of the recipe (target, distill, drafter, eval)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from engine.train.corpus import CorpusConfig
from engine.train.loop import LoopConfig


def _with_steps(loop: LoopConfig, steps: int | None) -> LoopConfig:
    return loop if steps is None else dataclasses.replace(loop, steps=steps)


def _target(corpus: CorpusConfig, args: argparse.Namespace) -> None:
    from engine.train.target import TargetConfig, train_target

    cfg = TargetConfig.smoke() if args.smoke else TargetConfig()
    cfg = dataclasses.replace(cfg, loop=_with_steps(cfg.loop, args.steps))
    train_target(corpus, args.out_dir / "target", args.runs_dir / "target", cfg)


def _distill(corpus: CorpusConfig, args: argparse.Namespace) -> None:
    from engine.train.distill import DistillConfig, run_distill

    cfg = DistillConfig.smoke() if args.smoke else DistillConfig()
    run_distill(corpus, args.out_dir / "target", args.runs_dir / "distill", cfg)


def _drafter(args: argparse.Namespace) -> None:
    from engine.train.distill import DistillConfig, load_distill
    from engine.train.drafter_training import DrafterTrainConfig, train_drafter
    from engine.train.tokenizer_recipe import ENDOFTEXT, IM_END, load_tokenizer, token_id

    target_dir = args.out_dir / "target"
    tok = load_tokenizer(target_dir)
    stops = [token_id(tok, IM_END), token_id(tok, ENDOFTEXT)]
    distill = DistillConfig.smoke() if args.smoke else DistillConfig()
    data = load_distill(args.runs_dir / "distill", distill.prompt_len, stops)
    if args.smoke:
        layers = json.loads((target_dir / "config.json").read_text())["num_hidden_layers"]
        cfg = DrafterTrainConfig.smoke(int(layers))
    else:
        cfg = DrafterTrainConfig()
    cfg = dataclasses.replace(cfg, loop=_with_steps(cfg.loop, args.steps))
    train_drafter(target_dir, data, args.out_dir / "dflash", args.runs_dir / "drafter", cfg)


def _eval(corpus: CorpusConfig, args: argparse.Namespace) -> None:
    from engine.train.evaluate import EvalConfig, run_eval

    cfg = EvalConfig(num_prompts=2, max_new_tokens=8) if args.smoke else EvalConfig()
    run_eval(corpus, args.out_dir, args.runs_dir / "eval.json", cfg)


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
