"""`dflash-train {tokenizer,target,distill,drafter,eval,all}`: the tiny-coder recipe.

Each stage reads the previous stage's outputs from disk, so stages can be re-run alone.
Checkpoints and logs go under `--runs-dir` (resumable); final artefacts under `--out-dir`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.train.corpus import CorpusConfig

STAGES = ("tokenizer", "target", "distill", "drafter", "eval")
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "assets" / "tiny-coder"


def layer_list(text: str) -> tuple[int, ...]:
    """`1,3,4` -> (1, 3, 4): distinct, non-negative layer indices in increasing order."""
    try:
        ids = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of layers: {text!r}"
        ) from None
    if any(i < 0 for i in ids) or list(ids) != sorted(set(ids)):
        raise argparse.ArgumentTypeError(f"layers must be distinct, >= 0 and increasing: {text!r}")
    return ids


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-train", description=__doc__)
    parser.add_argument("stage", choices=(*STAGES, "all"))
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT, help="tiny-coder folder")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/train"))
    parser.add_argument("--stdlib", type=Path, default=None, help="corpus root (default: stdlib)")
    parser.add_argument("--max-files", type=int, default=None, help="smoke runs: first N files")
    parser.add_argument("--steps", type=int, default=None, help="override training steps")
    parser.add_argument(
        "--target-layer-ids",
        type=layer_list,
        default=None,
        help="the drafter's context layers, e.g. 1,3,4 (default: the recipe's 1,3,5)",
    )
    parser.add_argument(
        "--drafter-dir",
        default="dflash",
        help="the drafter's folder under --out-dir (another name keeps the bundled drafter)",
    )
    # One thread: on a shared CPU, extra intra-op threads mostly spin (measured: 2 threads
    # ran 3-6x slower per step than 1 while other jobs were busy).
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes for a quick check")
    return parser


def run_stage(stage: str, args: argparse.Namespace) -> None:
    # Imports are per stage: the tokenizer stage needs no torch.
    corpus = CorpusConfig(root=args.stdlib, max_files=args.max_files)
    if stage == "tokenizer":
        from engine.train.tokenizer_recipe import run_tokenizer_stage

        run_tokenizer_stage(corpus, args.out_dir / "target", smoke=args.smoke)
        return
    from engine.train.stages import run_torch_stage

    run_torch_stage(stage, corpus, args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stages = STAGES if args.stage == "all" else (args.stage,)
    try:
        for stage in stages:
            print(f"== dflash-train: {stage}", file=sys.stderr, flush=True)
            run_stage(stage, args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"dflash-train: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
