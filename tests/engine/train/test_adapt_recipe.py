"""adapt's own recipe set: the `distill` stage's prompts and the bundled target's greedy
continuations with their features, in distill's chunk format, made once and read back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.train import adapt_recipe
from engine.train.adapt import recipe_examples
from engine.train.adapt_recipe import ensure_recipe_set, recipe_set_dir
from engine.train.corpus import CorpusConfig

TARGET = Path(__file__).resolve().parents[3] / "engine" / "assets" / "tiny-coder" / "target"
LAYERS = [1, 3, 5]
SMALL = CorpusConfig(max_files=4)  # a few stdlib files: prompts enough, seconds less


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_set_is_made_in_distill_format_and_a_rerun_reads_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = ensure_recipe_set(tmp_path, TARGET, LAYERS, 3, SMALL)
    assert folder == recipe_set_dir(tmp_path, TARGET, LAYERS, 3)
    assert folder.parent == tmp_path and [p.name for p in folder.glob("chunk_*.pt")] == [
        "chunk_0000.pt"
    ]
    rows = recipe_examples(folder, [2], LAYERS)
    assert len(rows) == 3
    for row in rows:
        assert row.prompt_len == 128 and 128 < row.tokens.numel() <= 256
        assert row.features.shape == (row.tokens.numel(), 3 * 256)
        assert row.features.dtype == torch.float16 and bool(row.features[:128].abs().sum() > 0)

    def no_build(*_: object) -> None:
        raise AssertionError("the cached set was made again")

    monkeypatch.setattr(adapt_recipe, "run_distill", no_build)
    assert ensure_recipe_set(tmp_path, TARGET, LAYERS, 3, SMALL) == folder
    # Another size or other layers: another folder, never a mix of the two.
    assert recipe_set_dir(tmp_path, TARGET, LAYERS, 4) != folder
    assert recipe_set_dir(tmp_path, TARGET, [1, 5], 3) != folder


def test_no_corpus_and_no_samples_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no recipe corpus"):
        ensure_recipe_set(tmp_path, TARGET, LAYERS, 2, CorpusConfig(root=tmp_path / "empty"))
    with pytest.raises(ValueError, match="positive"):
        ensure_recipe_set(tmp_path, TARGET, LAYERS, 0, SMALL)
