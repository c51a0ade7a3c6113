"""`dflash-train {tokenizer,target,distill,drafter,eval,all}`: the tiny-coder recipe.

Each stage reads the previous stage's outputs from disk, so stages can be re-run alone.
Checkpoints and logs go under `--runs-dir` (resumable); final artefacts under `--out-dir`.

`dflash-train adapt --data URI --out DIR ...` (options: `dflash-train adapt --help`)
adapts a drafter to captured traffic (engine/train/adapt.py); it is not part of `all`.
Exit status: 0 done, 1 error, 2 usage, 3 (adapt) tau did not rise and nothing was written.
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
    parser.add_argument("stage", choices=(*STAGES, "all", "adapt"))
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
        "--arch",
        choices=("dflash", "dflash2"),
        default="dflash",
        help="drafter stage: the drafter's architecture (dflash2: DFlash plus grouped "
        "convolutions and a candidate selector, engine/dflash2.py)",
    )
    parser.add_argument(
        "--drafter-dir",
        default=None,
        help="the drafter's folder under --out-dir (default: the --arch name; another name "
        "keeps the bundled drafter)",
    )
    parser.add_argument(
        "--eval-temperature",
        type=float,
        action="append",
        default=[],
        help="eval stage: also measure through the engine with seeded sampling at this "
        "temperature, beside a drafter drafting the target's own greedy choice on the same "
        "text (repeatable)",
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


def build_adapt_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-train adapt",
        description="Continue training a DFlash drafter on captured traffic; write it to --out "
        "only if tau on held-out traffic rose (exit 3 when it did not).",
    )
    parser.add_argument("--data", required=True, help="captured-traffic dataset URI")
    parser.add_argument("--out", type=Path, required=True, help="folder for the new drafter")
    parser.add_argument("--target", type=Path, default=DEFAULT_OUT / "target")
    parser.add_argument("--drafter", type=Path, default=DEFAULT_OUT / "dflash")
    parser.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="training time budget (resumed runs included); the learning rate decays over it",
    )
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default=None, help="default: cuda if any"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--runs-dir",
        type=Path,
        default=None,
        help="checkpoints (resumable) under RUNS_DIR/<hash of the inputs>; "
        "default: <parent of --out>/runs/adapt",
    )
    parser.add_argument(
        "--train-on",
        choices=("greedy", "captured"),
        default="greedy",
        help="for samples captured at T>0: the target's greedy continuation or the sampled text",
    )
    parser.add_argument(
        "--recipe-data",
        type=Path,
        default=Path("runs/train/distill"),
        help="the recipe's distillation chunks to mix in; when absent, --recipe-samples of "
        "them are made from the recipe's corpus and cached under --runs-dir",
    )
    parser.add_argument(
        "--recipe-samples",
        type=int,
        default=256,
        help="sequences to make when --recipe-data is absent (about 30 s on one CPU core); "
        "0: traffic only",
    )
    parser.add_argument("--recipe-mix", type=float, default=0.5, help="batch fraction of them")
    parser.add_argument("--batch-seqs", type=int, default=8, help="sequences per step")
    parser.add_argument("--eval-prompts", type=int, default=16, help="recipe prompts measured")
    parser.add_argument("--eval-tokens", type=int, default=64, help="greedy tokens measured each")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return parser


def adapt_main(argv: list[str]) -> int:
    parser = build_adapt_parser()
    args = parser.parse_args(argv)
    counts = {
        "--steps": args.steps,
        "--batch-seqs": args.batch_seqs,
        "--eval-prompts": args.eval_prompts,
        "--eval-tokens": args.eval_tokens,
    }
    for flag, count in counts.items():
        if count < 1:
            parser.error(f"{flag} must be positive, not {count}")
    if args.minutes is not None and args.minutes <= 0:
        parser.error("--minutes must be positive")
    if args.recipe_samples < 0:
        parser.error("--recipe-samples must be >= 0")
    if not 0.0 <= args.recipe_mix < 1.0:
        parser.error("--recipe-mix must be in [0, 1)")
    print("== dflash-train: adapt", file=sys.stderr, flush=True)
    try:
        import torch

        from engine.train.adapt import EXIT_NOT_IMPROVED, AdaptConfig, run_adapt

        torch.set_num_threads(args.threads)
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        cfg = AdaptConfig(
            # A folder as an absolute path (the manifest records where the data came from).
            data=args.data if "://" in args.data else str(Path(args.data).resolve()),
            out=args.out,
            target=args.target,
            drafter=args.drafter,
            runs_dir=args.runs_dir or args.out.resolve().parent / "runs" / "adapt",
            steps=args.steps,
            minutes=args.minutes,
            device=device,
            seed=args.seed,
            train_on=args.train_on,
            recipe_data=args.recipe_data,
            recipe_mix=args.recipe_mix,
            recipe_samples=args.recipe_samples,
            batch_seqs=args.batch_seqs,
            eval_prompts=args.eval_prompts,
            eval_tokens=args.eval_tokens,
        )
        result = run_adapt(cfg)
    except (FileNotFoundError, ValueError) as exc:
        print(f"dflash-train: error: {exc}", file=sys.stderr)
        return 1
    return 0 if result.written else EXIT_NOT_IMPROVED


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # adapt has its own options; the recipe stages keep theirs (and their positional form).
    if argv[:1] == ["adapt"]:
        return adapt_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.stage == "adapt":  # reached only with options before the stage name
        print(
            "dflash-train: error: name `adapt` first: dflash-train adapt --data ...",
            file=sys.stderr,
        )
        return 2
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
