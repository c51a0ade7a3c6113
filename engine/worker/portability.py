"""Which engine can serve which DFlash drafter: checked from the checkpoints' config.json alone,
before a process that would fail on its first request is started.

SGLang (0.5.x, `sglang/srt/models/qwen3.py`) captures the target's hidden state at the input
of layer `id + 1` for each id in `target_layer_ids`, so the output of the target's last layer
is never captured: a drafter that reads it fails at its first verify step with a feature
dimension mismatch. vLLM and TensorRT-LLM take the output of any layer. The published DFlash
drafters never read the last layer; the bundled tiny drafter does ([1, 3, 5] of 6 layers), its
portable sibling (`dflash-portable`, [1, 3, 4]) does not.
"""

from __future__ import annotations

from typing import Any

FIELD = "dflash_config.target_layer_ids"


def layer_ids(drafter: dict[str, Any]) -> list[int] | None:
    """The drafter's target_layer_ids (under dflash_config, or at the top level)."""
    nested = drafter.get("dflash_config")
    ids = nested.get("target_layer_ids") if isinstance(nested, dict) else None
    ids = ids if ids is not None else drafter.get("target_layer_ids")
    if isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return ids
    return None


def unportable(backend: str, drafter: dict[str, Any], target: dict[str, Any] | None) -> str | None:
    """Why `backend` cannot serve this drafter over this target, or None."""
    if backend != "sglang" or target is None:
        return None
    layers = target.get("num_hidden_layers")
    ids = layer_ids(drafter)
    if not isinstance(layers, int) or ids is None:
        return None
    if layers - 1 in ids:
        return (
            f"speculative_config.model: the drafter's {FIELD} {ids} include the target's last "
            f"layer ({layers - 1}), which SGLang cannot capture (it reads the input of layer "
            "id + 1): serve this drafter with --backend vllm or trtllm, or use a drafter "
            "trained on earlier layers"
        )
    return None
