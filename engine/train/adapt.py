"""`dflash-train adapt`: continue training a DFlash drafter on captured traffic (the flywheel).

Reads a captured-traffic dataset (wire/capture.py), rebuilds each completion's token
sequence (engine/train/adapt_data.py), splits requests into train and held-out by a hash of
their id, takes the target's context features for each training sequence (one no-grad
forward), and continues training the drafter from its checkpoint with the recipe's block
loss (engine/train/drafter_training.py). It measures the mean acceptance length tau at
temperature 0 (block = the drafter's block size; replay, engine/train/evaluate.py) before
and after, on the held-out traffic and on the recipe's held-out prompts, and writes the new
drafter (DFlash layout + manifest.json) to --out only when held-out traffic tau rose.

Training on samples captured at T > 0: `train_on="greedy"` (default) replaces their
completion by the target's own greedy continuation of the prompt (as long as the captured
one, cut after a stop token); `"captured"` trains on the sampled text as served. Samples
captured at T = 0 are the target's greedy output already and are used as captured either
way. Measured (bundled tiny-coder pair, 40 prose requests sampled at T = 0.8, 100 steps,
docs/training.md): held-out tau at T = 0 went 3.32 -> 6.40 with "greedy" and fell to 2.67
with "captured" (sampled tokens that are not the target's argmax teach drafts that greedy
verification rejects).

Recipe data (`recipe_data`, the `distill` stage's chunks) mixed into each batch keeps the
drafter's recipe skill: traffic only, recipe tau fell 4.20 -> 3.21; with 25 % recipe rows
it fell to 3.75, with 50 % (the default) to 4.00, for a small cost on traffic (8.17 and
7.84 against 8.53). Without distillation chunks (a fresh clone), adapt makes a small set of
the same kind itself (engine/train/adapt_recipe.py).

Exit status (engine/train/cli.py): 0 written; 3 tau did not rise, nothing written; 1 bad
input or a failed write (nothing half-written in --out).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

from engine.drafter import DFlashDrafter
from engine.loader import CheckpointError, load_drafter, load_target
from engine.model import Qwen3Target
from engine.tokenizer import Tokenizer
from engine.train.adapt_data import TrafficSequence, load_traffic, split_ids
from engine.train.adapt_recipe import ensure_recipe_set, has_chunks
from engine.train.blocks import BlockConfig, build_blocks, sample_anchors
from engine.train.corpus import CorpusConfig, heldout_prompts
from engine.train.distill import DistillConfig, generate_with_features, load_distill
from engine.train.drafter_training import acceptance_estimate, block_loss, save_compact
from engine.train.evaluate import Reference, greedy_references, mean_acceptance
from engine.train.loop import LoopConfig, train_loop
from wire.capture import open_store, shard_paths

TrainOn = Literal["greedy", "captured"]
EXIT_NOT_IMPROVED = 3
# Fewer held-out requests than this and the write gate's tau (before and after) is warned
# about: a rise on a handful of requests says little about the traffic.
FEW_HELD_OUT = 20
MANIFEST = "manifest.json"


class AdaptError(ValueError):
    """An adapt run that cannot go on or cannot write its result; the message says why."""


@dataclass(frozen=True)
class AdaptConfig:
    data: str  # dataset URI (wire/capture.py)
    out: Path
    target: Path
    drafter: Path
    runs_dir: Path  # checkpoints go to runs_dir/<hash of the inputs>
    steps: int = 300
    minutes: float | None = None  # training-time budget, resumptions included (None: steps)
    device: str = "cpu"
    seed: int = 0
    train_on: TrainOn = "greedy"
    # The recipe's own distillation chunks (`dflash-train distill`), mixed into each batch
    # so the drafter keeps its recipe skill. None or a missing folder: a set of
    # `recipe_samples` is made from the recipe's corpus (engine/train/adapt_recipe.py) and
    # cached under runs_dir; recipe_samples=0 then means traffic only.
    recipe_data: Path | None = None
    recipe_samples: int = 256
    recipe_mix: float = 0.5  # fraction of each batch's rows from recipe_data (measured)
    heldout_fraction: float = 0.15
    batch_seqs: int = 8
    anchors_per_seq: int = 16
    # Lower than the recipe's 2e-3: this continues a trained drafter; it does not start one.
    lr: float = 5e-4
    eval_prompts: int = 16  # recipe held-out prompts measured
    eval_tokens: int = 64  # greedy tokens per measured prompt (traffic: at most its own)


@dataclass(frozen=True)
class Example:
    tokens: torch.Tensor  # [L] int64, CPU
    prompt_len: int
    features: torch.Tensor  # [L, n * hidden] fp16, CPU


@dataclass(frozen=True)
class Tau:
    traffic: float
    recipe: float | None  # None: no recipe prompts (corpus root without held-out modules)


@dataclass(frozen=True)
class AdaptResult:
    written: bool
    before: Tau
    after: Tau
    steps: int
    minutes: float
    seconds_per_step: float
    num_train: int
    num_heldout: int
    manifest: dict[str, object]


def run_key(cfg: AdaptConfig, shards: list[str]) -> str:
    """A hash of what decides the training run: a rerun with the same inputs resumes it."""
    fields = dataclasses.asdict(cfg)
    for name in ("out", "runs_dir", "minutes", "device", "eval_prompts", "eval_tokens"):
        fields.pop(name)  # they change where the result goes or what is measured, not training
    fields.update(
        target=str(cfg.target.resolve()),
        drafter=str(cfg.drafter.resolve()),
        recipe_data=None if cfg.recipe_data is None else str(cfg.recipe_data.resolve()),
        shards=[s.rsplit("/", 1)[-1] for s in shards],
    )
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def check_out(out: Path) -> None:
    """--out must be new, empty, or an earlier adapt output (replaced as a whole)."""
    if out.exists() and not out.is_dir():
        raise AdaptError(f"--out {out} is a file")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise AdaptError(
            f"--out {out} holds files but no {MANIFEST} (not an adapt output): "
            "choose a new or empty folder"
        )


def load_pair(cfg: AdaptConfig) -> tuple[Tokenizer, Qwen3Target, DFlashDrafter]:
    """Tokenizer, target and drafter, checked to belong together (CheckpointError names the
    mismatched config key)."""
    tok = Tokenizer.from_dir(cfg.target)
    target = load_target(cfg.target, cfg.device).requires_grad_(False)
    drafter = load_drafter(cfg.drafter, target, cfg.device)
    mask = drafter.mask_token_id
    if not 0 <= mask < tok.vocab_size:
        raise CheckpointError(
            f"drafter {cfg.drafter}: mask_token_id {mask} is not in the target's tokenizer "
            f"({tok.vocab_size} tokens)"
        )
    return tok, target, drafter


def _cut_at_stop(tokens: list[int], start: int, stops: set[int]) -> list[int]:
    for i in range(start, len(tokens)):
        if tokens[i] in stops:
            return tokens[: i + 1]
    return tokens


@torch.no_grad()
def traffic_example(
    target: Qwen3Target,
    seq: TrafficSequence,
    layer_ids: list[int],
    train_on: TrainOn,
    stops: set[int],
) -> Example:
    """One training row: the sequence (or, for T > 0 with train_on="greedy", the prompt and
    the target's greedy continuation) and the target's features at `layer_ids`."""
    device = target.model.embed_tokens.weight.device
    n = len(seq.prompt)
    if train_on == "greedy" and seq.temperature > 0:
        ids, feats = generate_with_features(
            target, torch.tensor([seq.prompt], device=device), len(seq.completion), layer_ids
        )
        tokens = _cut_at_stop(ids[0].tolist(), n, stops)
        features = feats[0, : len(tokens)]
    else:
        tokens = seq.tokens
        ids = torch.tensor([tokens], device=device)
        positions = torch.arange(len(tokens), device=device)[None]
        out = target(ids, positions, layer_ids=layer_ids, logit_index=positions[:, -1:])
        assert out.hidden is not None
        features = out.hidden[0]
    return Example(torch.tensor(tokens), n, features.half().cpu())


def recipe_examples(path: Path | None, stops: list[int], layer_ids: list[int]) -> list[Example]:
    """The recipe's distillation rows, as examples; none when `path` is None or missing."""
    if path is None or not has_chunks(path):
        return []
    data = load_distill(path, DistillConfig().prompt_len, stops, layer_ids)
    return [
        Example(data.tokens[i, :n], data.prompt_len, data.features[i, :n])
        for i, n in enumerate(data.lengths.tolist())
    ]


def collate(rows: list[Example]) -> tuple[torch.Tensor, ...]:
    """tokens [b, L], lengths [b], prompt lengths [b], features [b, L, F] padded to the
    batch's longest row (padding is never attended: context keys stop before the anchor)."""
    width = max(int(r.tokens.numel()) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    features = torch.zeros(len(rows), width, rows[0].features.shape[-1], dtype=torch.float16)
    for i, r in enumerate(rows):
        tokens[i, : r.tokens.numel()] = r.tokens
        features[i, : r.tokens.numel()] = r.features
    lengths = torch.tensor([r.tokens.numel() for r in rows])
    prompt_lens = torch.tensor([r.prompt_len for r in rows])
    return tokens, lengths, prompt_lens, features


def _blocks(block_size: int, anchors: int) -> BlockConfig:
    # The recipe's mix of block lengths (4, 8, full, full), capped at this drafter's size.
    lengths = tuple(min(n, block_size) for n in (4, 8, block_size, block_size))
    return BlockConfig(block_size=block_size, anchors_per_seq=anchors, gamma=7.0, lengths=lengths)


def train(
    drafter: DFlashDrafter,
    traffic: list[Example],
    recipe: list[Example],
    cfg: AdaptConfig,
    run_dir: Path,
) -> tuple[int, int, float]:
    """Continue training `drafter` (resumable in `run_dir`): (steps done in all, steps run
    by this call, seconds this call spent)."""
    blocks = _blocks(drafter.block_size, cfg.anchors_per_seq)
    n_recipe = min(round(cfg.batch_seqs * cfg.recipe_mix), cfg.batch_seqs - 1) if recipe else 0
    n_traffic = cfg.batch_seqs - n_recipe
    device = drafter.fc.weight.device
    ran = [0]  # steps run by this call (a resumed run has done some before)

    def step_fn(step: int, gen: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        ran[0] += 1
        rows = [
            traffic[int(i)] for i in torch.randint(0, len(traffic), (n_traffic,), generator=gen)
        ]
        if n_recipe:
            picks = torch.randint(0, len(recipe), (n_recipe,), generator=gen)
            rows += [recipe[int(i)] for i in picks]
        tokens, lengths, prompt_lens, features = collate(rows)
        anchors = sample_anchors(lengths, prompt_lens, blocks, gen)
        batch = build_blocks(tokens, lengths, anchors, drafter.mask_token_id, blocks, gen)
        loss, hits = block_loss(drafter, features.to(device).float(), batch.to(device))
        tau = acceptance_estimate(hits.cpu(), batch.weights, blocks.block_size)
        return loss, {"loss": float(loss.detach()), "tau": tau}

    loop = LoopConfig(
        steps=cfg.steps,
        lr=cfg.lr,
        warmup=max(1, min(20, cfg.steps // 10)),
        weight_decay=0.01,
        ckpt_every=max(1, min(50, cfg.steps // 4)),
        log_every=max(1, min(10, cfg.steps // 10)),
        seed=cfg.seed,
        # --minutes bounds the run's training over its resumptions, and the cosine spans it.
        seconds=None if cfg.minutes is None else 60.0 * cfg.minutes,
    )
    torch.manual_seed(cfg.seed)
    t0 = time.monotonic()
    done = train_loop(drafter, step_fn, loop, run_dir, "adapt")
    return done, ran[0], time.monotonic() - t0


@dataclass(frozen=True)
class EvalSet:
    prompts: list[list[int]]
    refs: list[Reference]


def traffic_evalset(
    target: Qwen3Target, held: list[TrafficSequence], layer_ids: list[int], max_new: int
) -> EvalSet:
    """One greedy reference per held-out request (its first completion's length, capped):
    tau at temperature 0 is about the target's greedy output, whatever was sampled."""
    first: dict[str, TrafficSequence] = {}
    for seq in held:
        first.setdefault(seq.sample_id, seq)
    prompts = [s.prompt for s in first.values()]
    lengths = [min(len(s.completion), max_new) for s in first.values()]
    return EvalSet(prompts, greedy_references(target, prompts, lengths, layer_ids))


def recipe_evalset(
    target: Qwen3Target, tok: Tokenizer, layer_ids: list[int], n: int, max_new: int
) -> EvalSet | None:
    try:
        texts = heldout_prompts(n, config=CorpusConfig())
    except ValueError:  # a Python without the held-out stdlib modules
        return None
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    return EvalSet(prompts, greedy_references(target, prompts, [max_new] * n, layer_ids))


def measure(drafter: DFlashDrafter, traffic: EvalSet, recipe: EvalSet | None) -> Tau:
    block = drafter.block_size
    tau, _ = mean_acceptance(drafter, traffic.prompts, traffic.refs, block)
    rec = (
        None if recipe is None else mean_acceptance(drafter, recipe.prompts, recipe.refs, block)[0]
    )
    return Tau(tau, rec)


def round_to_saved(drafter: DFlashDrafter) -> None:
    """Weights as the checkpoint stores them (bf16, save_compact), so the tau measured after
    training is the written drafter's."""
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


def write_drafter(drafter: DFlashDrafter, out: Path, manifest: dict[str, object]) -> None:
    """Write into a temporary folder beside `out`, then rename it into place: `out` is the
    old content or the new, never a mix. On any OSError (a full disk) the temporary folder
    is removed and `out` is left as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_compact(drafter, tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        if out.exists():  # an earlier adapt output (check_out): swap, then drop the old one
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            old.rmdir()
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise AdaptError(
            f"cannot write the adapted drafter to {out}: {exc}; {out} is unchanged"
        ) from None


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def report(before: Tau, after: Tau, block: int, n_traffic: int, n_recipe: int) -> None:
    rows = [
        (f"held-out traffic ({n_traffic} requests)", before.traffic, after.traffic),
        (f"recipe held-out ({n_recipe} prompts)", before.recipe, after.recipe),
    ]
    print(f"adapt: tau at temperature 0, block {block}{'before':>14} {'after':>8}")
    for name, old, new in rows:
        print(f"  {name:<36} {_fmt(old):>8} {_fmt(new):>8}")


def recipe_folder(cfg: AdaptConfig, layer_ids: list[int]) -> Path | None:
    """cfg.recipe_data when it holds distillation chunks; else a small set made from the
    recipe's corpus (cached under cfg.runs_dir), so a fresh clone does not forget; None for
    traffic only (no mixing asked, no samples asked, or no corpus on this Python)."""
    if not cfg.recipe_mix or has_chunks(cfg.recipe_data):
        return cfg.recipe_data
    if cfg.recipe_samples < 1:
        return None
    try:
        folder = ensure_recipe_set(cfg.runs_dir, cfg.target, layer_ids, cfg.recipe_samples)
    except ValueError as exc:
        print(f"dflash-train: warning: cannot make recipe data ({exc})", file=sys.stderr)
        return None
    print(f"adapt: no recipe distillation data in {cfg.recipe_data}: using {folder}")
    return folder


def run_adapt(cfg: AdaptConfig) -> AdaptResult:
    check_out(cfg.out)
    tok, target, drafter = load_pair(cfg)
    traffic = load_traffic(
        cfg.data, tok, target.config.vocab_size, target.config.max_position_embeddings
    )
    for warning in traffic.warnings:
        print(f"dflash-train: warning: {warning}", file=sys.stderr)
    train_ids, held_ids = split_ids(
        (s.sample_id for s in traffic.sequences), cfg.heldout_fraction, cfg.seed
    )
    layer_ids = list(drafter.config.target_layer_ids)
    stops = set(tok.eos_token_ids)
    train_seqs = [s for s in traffic.sequences if s.sample_id in train_ids]
    held_seqs = [s for s in traffic.sequences if s.sample_id in held_ids]
    print(
        f"adapt: {traffic.num_samples} samples, {len(train_ids)} requests to train on "
        f"({len(train_seqs)} sequences), {len(held_ids)} held out"
    )
    if len(held_ids) < FEW_HELD_OUT:
        print(
            f"adapt: warning: only {len(held_ids)} requests held out; the gate below (held-out "
            f"tau rose) rests on them alone: capture more traffic ({FEW_HELD_OUT} or more held "
            "out) before trusting it"
        )
    examples = [
        traffic_example(target, s, layer_ids, cfg.train_on, stops)
        for s in tqdm(train_seqs, desc="features")
    ]
    # The run key below names the recipe folder actually mixed in.
    cfg = dataclasses.replace(cfg, recipe_data=recipe_folder(cfg, layer_ids))
    recipe = recipe_examples(cfg.recipe_data, sorted(stops), layer_ids) if cfg.recipe_mix else []
    print(
        f"adapt: {len(recipe)} recipe sequences mixed in ({cfg.recipe_mix:.0%} of each batch)"
        if recipe
        else "adapt: no recipe distillation data: traffic only"
    )

    traffic_eval = traffic_evalset(target, held_seqs, layer_ids, cfg.eval_tokens)
    recipe_eval = recipe_evalset(target, tok, layer_ids, cfg.eval_prompts, cfg.eval_tokens)
    before = measure(drafter, traffic_eval, recipe_eval)

    fs, root = open_store(cfg.data)
    run_dir = cfg.runs_dir / run_key(cfg, shard_paths(fs, root))
    steps, ran, seconds = train(drafter, examples, recipe, cfg, run_dir)
    round_to_saved(drafter)
    after = measure(drafter, traffic_eval, recipe_eval)
    n_recipe = 0 if recipe_eval is None else len(recipe_eval.prompts)
    report(before, after, drafter.block_size, len(traffic_eval.prompts), n_recipe)

    manifest: dict[str, object] = {
        "source_drafter": str(cfg.drafter.resolve()),
        "target": str(cfg.target.resolve()),
        "data": cfg.data,
        "samples": {"read": traffic.num_samples, "skipped": len(traffic.warnings)},
        "requests": {"train": len(train_ids), "heldout": len(held_ids)},
        "sequences": {"train": len(examples), "recipe": len(recipe)},
        "train_on": cfg.train_on,
        "recipe_mix": cfg.recipe_mix if recipe else 0.0,
        "recipe_data": str(cfg.recipe_data) if recipe else None,
        "steps": steps,
        "minutes": round(seconds / 60.0, 3),
        "block_size": drafter.block_size,
        "tau": {
            "traffic": {"before": before.traffic, "after": after.traffic},
            "recipe": {"before": before.recipe, "after": after.recipe},
        },
        "seed": cfg.seed,
        "run_dir": str(run_dir),
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    written = after.traffic > before.traffic
    if written:
        write_drafter(drafter, cfg.out, manifest)
        print(f"adapt: held-out traffic tau rose: wrote {cfg.out}")
    else:
        print(
            f"adapt: held-out traffic tau did not rise ({_fmt(before.traffic)} -> "
            f"{_fmt(after.traffic)}): nothing written to {cfg.out}"
        )
    return AdaptResult(
        written=written,
        before=before,
        after=after,
        steps=steps,
        minutes=seconds / 60.0,
        seconds_per_step=seconds / max(1, ran),
        num_train=len(train_ids),
        num_heldout=len(held_ids),
        manifest=manifest,
    )
