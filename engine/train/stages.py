"""Torch stages of the recipe (target, distill, drafter, eval); filled in by issue 4."""

from __future__ import annotations

import argparse

from engine.train.corpus import CorpusConfig


def run_torch_stage(stage: str, corpus: CorpusConfig, args: argparse.Namespace) -> None:
    raise ValueError(f"stage {stage!r} is not implemented yet")
