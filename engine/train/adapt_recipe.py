"""A small recipe set for `dflash-train adapt` when the recipe's distillation data is absent.

adapt mixes the recipe's own distillation rows into each batch so the drafter keeps its
recipe skill (traffic only, recipe tau fell 4.20 -> 3.21). Those rows come from
`dflash-train distill` (runs/train/distill), which a fresh clone does not have. The corpus
they are cut from is this interpreter's stdlib, present on every machine, so adapt makes a
bounded set itself: the `distill` stage's own prompts and greedy continuations with context
features (engine/train/distill.py), `samples` of them instead of 2048. Measured on the
bundled pair, 1 CPU thread: 32 sequences (128 prompt + 128 generated tokens) in 2.6 s, and
3.2 s to read and tokenize the corpus once; 256 sequences take about half a minute and
100 MB of features. With them (100 steps on 40 prose requests), recipe tau went 4.20 -> 4.13
where traffic only lost it to 3.05 (docs/training.md).

The set is kept under the runs folder, keyed by what decides its content (target, layers,
sample count), so a rerun reads it back instead of generating it again; an interrupted build
resumes at its next chunk (run_distill's own resumption).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from engine.train.corpus import CorpusConfig, training_files
from engine.train.distill import DistillConfig, run_distill

# Sequences generated together (one batch, one saved chunk): small enough that an interrupted
# build loses little, large enough to batch the target's forward passes.
CHUNK = 32


def has_chunks(path: Path | None) -> bool:
    return path is not None and path.is_dir() and any(path.glob("chunk_*.pt"))


def recipe_set_dir(runs_dir: Path, target: Path, layer_ids: list[int], samples: int) -> Path:
    """Where the set for these inputs lives: runs_dir/recipe-<hash>."""
    key = {"target": str(target.resolve()), "layer_ids": layer_ids, "samples": samples}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return runs_dir / f"recipe-{digest}"


def ensure_recipe_set(
    runs_dir: Path,
    target: Path,
    layer_ids: list[int],
    samples: int,
    corpus: CorpusConfig | None = None,
) -> Path:
    """The folder of a recipe set of `samples` sequences (rounded up to whole chunks of
    CHUNK) for `target`, built when not cached. ValueError when this Python has no stdlib
    sources to cut prompts from."""
    if samples < 1:
        raise ValueError(f"recipe samples must be positive, not {samples}")
    corpus = corpus or CorpusConfig()
    folder = recipe_set_dir(runs_dir, target, layer_ids, samples)
    expected = -(-samples // CHUNK)
    if len(list(folder.glob("chunk_*.pt"))) >= expected:
        return folder
    if not training_files(corpus):
        raise ValueError(f"no recipe corpus: no Python sources under {corpus.stdlib_root()}")
    cfg = DistillConfig(num_sequences=samples, chunk=min(CHUNK, samples))
    run_distill(corpus, target, folder, cfg, layer_ids)
    return folder
