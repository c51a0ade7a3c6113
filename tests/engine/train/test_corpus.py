"""Corpus selection: deterministic, and the held-out modules never reach training."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.train.corpus import (
    HELDOUT_MODULES,
    CorpusConfig,
    heldout_files,
    heldout_prompts,
    read_text,
    top_level_name,
    training_files,
)


def _fake_stdlib(root: Path) -> Path:
    body = "import os\n\n\nclass Thing:\n    def run(self):\n        return os.sep\n" * 10
    for rel in [
        "json/__init__.py",
        "json/decoder.py",
        "csv.py",
        "os_helpers.py",
        "test/test_x.py",
        "encodings/cp1.py",
        "pkg/mod.py",
        "idlelib/a.py",
    ]:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    (root / "tiny.py").write_text("x = 1\n")  # below the size floor
    return root


def test_selection_is_sorted_deterministic_and_filtered(tmp_path: Path) -> None:
    config = CorpusConfig(root=_fake_stdlib(tmp_path))
    first, second = training_files(config), training_files(config)
    assert first == second
    rels = [p.relative_to(tmp_path).as_posix() for p in first]
    assert rels == ["os_helpers.py", "pkg/mod.py"]  # tests, codecs, GUI, tiny, held-out gone
    held = [p.relative_to(tmp_path).as_posix() for p in heldout_files(config)]
    assert held == ["csv.py", "json/__init__.py", "json/decoder.py"]


def test_real_stdlib_heldout_never_in_training() -> None:
    config = CorpusConfig()
    train, held = training_files(config), heldout_files(config)
    assert len(train) > 100 and len(held) >= len(HELDOUT_MODULES) - 2
    root = config.stdlib_root()
    assert not {top_level_name(p.relative_to(root)) for p in train} & set(HELDOUT_MODULES)
    assert not set(train) & set(held)
    assert training_files(CorpusConfig(max_files=5)) == train[:5]


def test_heldout_prompts_come_from_heldout_files() -> None:
    prompts = heldout_prompts(12)
    assert prompts == heldout_prompts(12)
    assert len(prompts) == 12 and len(set(prompts)) == 12
    texts = [read_text(p) for p in heldout_files(CorpusConfig())]
    for prompt in prompts:
        assert 0 < len(prompt) <= 600
        assert prompt.rstrip().endswith(":")  # ends on a def/class line
        assert any(prompt in text for text in texts)
    assert heldout_prompts(0) == []


def test_heldout_prompts_need_heldout_modules(tmp_path: Path) -> None:
    (tmp_path / "other.py").write_text("def f():\n    pass\n" * 30)
    with pytest.raises(ValueError, match="no held-out prompts"):
        heldout_prompts(3, config=CorpusConfig(root=tmp_path))
