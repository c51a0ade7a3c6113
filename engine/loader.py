"""Reading and writing checkpoints: HF Qwen3 targets and DFlash / DFlash2 drafters.

A drafter's kind comes from its config's `architectures` (as vLLM decides it):
`DFlashDraftModel` or `DFlash2DraftModel` (engine/dflash2.py).

Every problem with a checkpoint surfaces as `CheckpointError` with a one-line message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine.dflash2 import ARCHITECTURE as DFLASH2_ARCHITECTURE
from engine.dflash2 import DFlash2Config, DFlash2Drafter
from engine.drafter import DFlashDrafter, DrafterConfig
from engine.jsonfile import read_json_object
from engine.model import Qwen3Target, TargetConfig

WEIGHTS = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be used (missing, malformed, or mismatched)."""


def read_config(path: Path) -> dict[str, Any]:
    try:
        return read_json_object(Path(path) / "config.json")
    except ValueError as exc:
        raise CheckpointError(str(exc)) from exc


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    file = Path(path) / WEIGHTS
    try:
        return load_file(str(file))
    except Exception as exc:  # safetensors raises its own error type for corrupt headers
        raise CheckpointError(f"cannot read {file}: {exc}") from exc


def _load_state(
    module: nn.Module,
    weights: dict[str, torch.Tensor],
    where: Path,
    optional: frozenset[str] = frozenset(),
) -> None:
    expected = set(module.state_dict())
    missing = sorted(expected - set(weights) - optional)
    unexpected = sorted(set(weights) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: weights do not match the config (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    try:
        module.load_state_dict(weights, strict=False)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[-1].strip()
        raise CheckpointError(f"{where}: {first}") from exc


def load_target(
    path: Path | str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Qwen3Target:
    path = Path(path)
    raw = read_config(path)
    if raw.get("model_type") not in (None, "qwen3"):
        raise CheckpointError(f"{path}: model_type {raw.get('model_type')!r} is not qwen3")
    try:
        config = TargetConfig.from_dict(raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}/config.json: bad or missing field {exc}") from exc
    model = Qwen3Target(config)
    optional = frozenset({"lm_head.weight"} if config.tie_word_embeddings else ())
    _load_state(model, _read_weights(path), path, optional)
    return model.to(device=device, dtype=dtype).eval()


def _check_pair(config: DrafterConfig, target: Qwen3Target, path: Path) -> None:
    tc = target.config
    problems = []
    if config.hidden_size != tc.hidden_size:
        problems.append(f"hidden_size {config.hidden_size} != target {tc.hidden_size}")
    if config.vocab_size != tc.vocab_size:
        problems.append(f"vocab_size {config.vocab_size} != target {tc.vocab_size}")
    if config.num_target_layers != tc.num_hidden_layers:
        problems.append(
            f"num_target_layers {config.num_target_layers} != target {tc.num_hidden_layers}"
        )
    if any(not 0 <= i < tc.num_hidden_layers for i in config.target_layer_ids):
        problems.append(f"target_layer_ids {config.target_layer_ids} out of range")
    if not 0 <= config.mask_token_id < tc.vocab_size:
        problems.append(f"mask_token_id {config.mask_token_id} outside the vocabulary")
    if problems:
        raise CheckpointError(f"drafter {path} does not fit the target: {'; '.join(problems)}")


def load_drafter(
    path: Path | str,
    target: Qwen3Target,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> DFlashDrafter:
    """A DFlash or DFlash2 drafter (by `architectures`) fitted to `target`."""
    path = Path(path)
    raw = read_config(path)
    architectures = raw.get("architectures") or []
    if not {"DFlashDraftModel", DFLASH2_ARCHITECTURE} & set(architectures):
        raise CheckpointError(
            f"{path}: architectures must include DFlashDraftModel or {DFLASH2_ARCHITECTURE}"
        )
    try:
        config = DrafterConfig.from_dict(raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}/config.json: bad or missing field {exc}") from exc
    _check_pair(config, target, path)
    weights = _read_weights(path)
    drafter: DFlashDrafter
    if DFLASH2_ARCHITECTURE in architectures:
        extra = _dflash2_config(raw, config, path)
        _check_dflash2_weights(weights, config, extra, path)
        drafter = DFlash2Drafter(config, extra, target.model.embed_tokens, target.lm_head)
    else:
        drafter = DFlashDrafter(config, target.model.embed_tokens, target.lm_head)
    _load_state(drafter, weights, path)
    return drafter.to(device=device, dtype=dtype).eval()


def _dflash2_config(raw: dict[str, Any], config: DrafterConfig, path: Path) -> DFlash2Config:
    where = f"{path}/config.json"
    try:
        extra = DFlash2Config.from_dict(raw.get("dflash_config") or {})
    except KeyError as exc:
        raise CheckpointError(f"{where}: missing dflash_config.{exc.args[0]}") from exc
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: bad dflash_config field ({exc})") from exc
    problems = extra.problems(config.hidden_size, config.vocab_size)
    # One block token and at least one mask row for the selector to score.
    if config.block_size < 2:
        problems.append(f"block_size {config.block_size} must be >= 2")
    if problems:
        raise CheckpointError(f"{where}: {'; '.join(problems)}")
    return extra


def _check_dflash2_weights(
    weights: dict[str, torch.Tensor], config: DrafterConfig, extra: DFlash2Config, path: Path
) -> None:
    """Shapes that follow from dflash_config, checked before loading so that the message
    names the key and the setting it contradicts (vLLM would load them unchecked)."""
    hidden, taps = config.hidden_size, extra.conv_kernel_size
    groups = hidden // extra.conv_group_size
    expected: dict[str, tuple[int, ...]] = {
        "candidate_selector.predecessor_codebook": (config.vocab_size, extra.selector_rank),
        "candidate_selector.successor_codebook": (config.vocab_size, extra.selector_rank),
        "candidate_selector.hidden_projection.weight": (extra.selector_rank, hidden),
    }
    for i in range(config.num_hidden_layers):
        for conv in ("attention_conv", "mlp_conv"):
            expected[f"layers.{i}.{conv}.base_kernel"] = (2, taps, hidden)
            expected[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * taps * groups, hidden)
    for key, shape in expected.items():
        if key not in weights:
            raise CheckpointError(f"{path}: missing DFlash2 weight {key}")
        if tuple(weights[key].shape) != shape:
            raise CheckpointError(
                f"{path}: {key} has shape {list(weights[key].shape)}, expected {list(shape)} "
                f"(conv_kernel_size {taps}, conv_group_size {extra.conv_group_size}, "
                f"selector_rank {extra.selector_rank}, hidden_size {hidden})"
            )


def _save(
    module: nn.Module, config: dict[str, Any], path: Path | str, skip: frozenset[str] = frozenset()
) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {
        k: v.detach().to("cpu").contiguous()
        for k, v in module.state_dict().items()
        if k not in skip
    }
    save_file(state, str(path / WEIGHTS), metadata={"format": "pt"})


def save_drafter(drafter: DFlashDrafter, path: Path | str) -> None:
    """Write config.json + model.safetensors (layers.N.*, fc, hidden_norm, norm only; a
    DFlash2 drafter adds its convolutions and candidate_selector.*)."""
    if isinstance(drafter, DFlash2Drafter):
        _save(drafter, drafter.to_hf_dict(), path)
        return
    _save(drafter, drafter.config.to_hf_dict(), path)


def save_target(target: Qwen3Target, path: Path | str) -> None:
    """Write an HF Qwen3ForCausalLM folder (no lm_head.weight when tied, as HF does)."""
    skip = frozenset({"lm_head.weight"} if target.config.tie_word_embeddings else ())
    _save(target, target.config.to_hf_dict(), path, skip)
