"""Checkpoint loading: the tiny fixture folders load; mismatches give CheckpointError."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.loader import CheckpointError, load_drafter, load_target, save_target
from tests.fixtures.tiny_models import (
    TinyCheckpoint,
    build_tiny_checkpoint,
    random_target,
    tiny_target_config,
)


def test_tiny_checkpoint_loads_and_pairs(tiny_checkpoint: TinyCheckpoint) -> None:
    target = load_target(tiny_checkpoint.target_dir)
    drafter = load_drafter(tiny_checkpoint.drafter_dir, target)
    assert drafter.block_size == 4
    assert drafter.config.vocab_size == target.config.vocab_size
    assert drafter.config.target_layer_ids == [2]  # 4 target layers, 1 draft layer
    assert (tiny_checkpoint.target_dir / "config.json").exists()
    raw = json.loads((tiny_checkpoint.target_dir / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3ForCausalLM"] and raw["model_type"] == "qwen3"


def test_drafter_for_another_target_is_rejected(tmp_path: Path) -> None:
    small = build_tiny_checkpoint(tmp_path / "a", vocab_size=32, num_hidden_layers=2)
    big = build_tiny_checkpoint(tmp_path / "b", vocab_size=32, num_hidden_layers=4)
    with pytest.raises(CheckpointError, match="num_target_layers 4 != target 2"):
        load_drafter(big.drafter_dir, load_target(small.target_dir))


def test_broken_folders_raise_checkpoint_error(
    tmp_path: Path, tiny_checkpoint: TinyCheckpoint
) -> None:
    with pytest.raises(CheckpointError, match="cannot read"):
        load_target(tmp_path / "missing")
    bad = tmp_path / "bad"
    shutil.copytree(tiny_checkpoint.target_dir, bad)
    raw = json.loads((bad / "config.json").read_text())
    raw["num_hidden_layers"] = 5
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="missing"):
        load_target(bad)
    (bad / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_target(bad)


def test_dtype_is_applied_and_tied_weights_stay_tied(tmp_path: Path) -> None:
    save_target(random_target(tiny_target_config(16, 1, tie_word_embeddings=True)), tmp_path)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    target = load_target(tmp_path, "cpu", torch.bfloat16)
    assert target.lm_head.weight.dtype == torch.bfloat16
    assert target.lm_head.weight is target.model.embed_tokens.weight
