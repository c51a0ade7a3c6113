"""DFlash drafter: layout, default layer ids, cached == cache-free forward, save/load."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.drafter import DFlashDrafter, DrafterConfig, default_target_layer_ids
from engine.loader import load_drafter, save_drafter
from engine.model import Qwen3Target
from tests.fixtures.tiny_models import random_drafter, random_target, tiny_target_config


def _pair(num_layers: int = 2) -> tuple[Qwen3Target, DFlashDrafter]:
    target = random_target(tiny_target_config(40, 6), seed=5)
    return target, random_drafter(target, block_size=4, num_layers=num_layers, seed=6)


def test_default_target_layer_ids_follow_the_reference() -> None:
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(28, 1) == [14]
    assert default_target_layer_ids(6, 2) == [1, 3]
    config = DrafterConfig(
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        vocab_size=10,
        num_target_layers=12,
        mask_token_id=9,
    )
    assert config.target_layer_ids == [1, 5, 9]


def test_saved_checkpoint_has_the_public_layout(tmp_path: Path) -> None:
    _, drafter = _pair()
    save_drafter(drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == 4 and config["num_target_layers"] == 6
    assert config["dflash_config"] == {"mask_token_id": 39, "target_layer_ids": [1, 3]}
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= keys
    assert "layers.1.self_attn.k_norm.weight" in keys
    assert not any("embed" in k or "lm_head" in k for k in keys)
    assert load_file(str(tmp_path / "model.safetensors"))["fc.weight"].shape == (32, 64)


def test_round_trip_gives_identical_outputs(tmp_path: Path) -> None:
    target, drafter = _pair()
    save_drafter(drafter, tmp_path)
    loaded = load_drafter(tmp_path, target)
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(2, 5, 64, generator=gen)
    ids = torch.randint(0, 40, (2, 4), generator=gen)
    ctx_pos = torch.arange(5)[None].expand(2, 5)
    blk_pos = torch.arange(5, 9)[None].expand(2, 4)
    with torch.no_grad():
        expected = drafter(ids, blk_pos, feats, ctx_pos)
        assert torch.equal(loaded(ids, blk_pos, feats, ctx_pos), expected)


def test_cached_drafting_equals_the_cache_free_forward() -> None:
    """Context appended to the slot cache in two chunks, rows of different lengths in
    non-adjacent slots, gives the same hidden states as one cache-free forward per row."""
    _, drafter = _pair()
    gen = torch.Generator().manual_seed(1)
    lengths = [6, 3]
    feats = torch.randn(2, 6, 64, generator=gen)
    cache = drafter.new_cache(num_slots=4, capacity=16, device="cpu", dtype=torch.float32)
    slots = torch.tensor([3, 1])
    pos = torch.arange(6)[None].expand(2, 6)
    valid = pos < torch.tensor(lengths)[:, None]
    with torch.no_grad():
        drafter.append_context(feats[:, :2], pos[:, :2], valid[:, :2], cache, slots)
        drafter.append_context(feats[:, 2:], pos[:, 2:], valid[:, 2:], cache, slots)
        block = torch.full((2, 4), drafter.mask_token_id)
        block[:, 0] = torch.tensor([7, 8])
        blk_pos = torch.stack([torch.arange(n, n + 4) for n in lengths])
        cached = drafter.draft_hidden(block, blk_pos, cache, slots, torch.tensor(lengths))
        for r, n in enumerate(lengths):
            ref = drafter(
                block[r : r + 1], blk_pos[r : r + 1], feats[r : r + 1, :n], pos[r : r + 1, :n]
            )
            torch.testing.assert_close(cached[r : r + 1], ref, atol=1e-5, rtol=1e-5)


# The names vLLM 0.33's DFlashQwen3ForCausalLM.load_weights maps (q/k/v -> qkv_proj,
# gate/up -> gate_up_proj, everything else prefixed with "model.").
VLLM_KEYS = re.compile(
    r"(layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)"
    r"|mlp\.(gate_proj|up_proj|down_proj)|input_layernorm|post_attention_layernorm)"
    r"|fc|hidden_norm|norm)\.weight"
)


def test_every_saved_key_is_one_vllm_loads(tmp_path: Path) -> None:
    _, drafter = _pair(num_layers=3)
    save_drafter(drafter, tmp_path)
    keys = list(load_file(str(tmp_path / "model.safetensors")))
    assert len(keys) == 3 * 11 + 3
    assert all(VLLM_KEYS.fullmatch(k) for k in keys), keys


def test_missing_target_layer_ids_get_the_reference_default(tmp_path: Path) -> None:
    target, drafter = _pair(num_layers=2)
    save_drafter(drafter, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["dflash_config"]["target_layer_ids"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_drafter(tmp_path, target).config.target_layer_ids == [1, 3]  # L=6: 1..L-3
