"""Stage `drafter`: train the DFlash (or, with `dflash2` settings, DFlash2) drafter on the
self-distillation data.

The drafter is the engine's own `engine.drafter.DFlashDrafter` (its cache-free forward),
borrowing the frozen target's `embed_tokens` and `lm_head`, so the saved checkpoint is
exactly what the engine (and vLLM's DFlash loader) reads. Context features come from the
engine's target model (`Qwen3Target`, hidden states at `target_layer_ids`), recomputed per
batch under no_grad.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.dflash2 import DFlash2Config, DFlash2Drafter
from engine.drafter import DFlashDrafter, DrafterConfig
from engine.loader import load_target, save_drafter
from engine.model import Qwen3Target
from engine.train.blocks import BlockBatch, BlockConfig, build_blocks, sample_anchors
from engine.train.dflash2_training import dflash2_loss, to_dflash2
from engine.train.distill import DistillData
from engine.train.loop import LoopConfig, train_loop
from engine.train.target import SERVING_DTYPE
from engine.train.tokenizer_recipe import MASK, load_tokenizer, token_id


@dataclass(frozen=True)
class DrafterTrainConfig:
    num_layers: int = 2
    target_layer_ids: tuple[int, ...] = (1, 3, 5)
    batch_seqs: int = 8
    blocks: BlockConfig = field(default_factory=BlockConfig)
    loop: LoopConfig = field(
        default_factory=lambda: LoopConfig(steps=3000, lr=2e-3, warmup=100, weight_decay=0.01)
    )
    dflash2: DFlash2Config | None = None  # None: DFlash; else DFlash2 with these settings
    selector_weight: float = 1.0  # DFlash2: weight of the selector loss (dflash2_training)

    @classmethod
    def smoke(cls, num_target_layers: int, steps: int = 3) -> DrafterTrainConfig:
        return cls(
            num_layers=1,
            target_layer_ids=(num_target_layers - 1,),
            batch_seqs=2,
            blocks=BlockConfig(block_size=4, anchors_per_seq=2, gamma=2.0, lengths=(2, 4)),
            loop=LoopConfig(steps=steps, lr=1e-3, warmup=1, ckpt_every=2),
        )


def build_drafter(target: Qwen3Target, mask_id: int, cfg: DrafterTrainConfig) -> DFlashDrafter:
    """A drafter shaped like the target's layers; draft layers start as copies of the
    target's last layers (same residual space), which trains faster than random init."""
    tc = target.config
    config = DrafterConfig(
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.head_dim,
        vocab_size=tc.vocab_size,
        num_target_layers=tc.num_hidden_layers,
        mask_token_id=mask_id,
        block_size=cfg.blocks.block_size,
        target_layer_ids=list(cfg.target_layer_ids),
        rms_norm_eps=tc.rms_norm_eps,
        rope_theta=tc.rope_theta,
        max_position_embeddings=tc.max_position_embeddings,
    )
    drafter = DFlashDrafter(config, target.model.embed_tokens, target.lm_head)
    sources = list(target.model.layers)[-cfg.num_layers :]
    for layer, source in zip(drafter.layers, sources, strict=True):
        layer.load_state_dict(source.state_dict())
    drafter.norm.load_state_dict(target.model.norm.state_dict())
    return drafter


def block_loss(
    drafter: DFlashDrafter, features: torch.Tensor, batch: BlockBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted cross-entropy over the block, and the per-slot hit mask (argmax == label)."""
    b, seq_len, _ = features.shape
    ctx_pos = torch.arange(seq_len, device=features.device).expand(b, seq_len)
    hidden = drafter(batch.block_ids, batch.positions, features, ctx_pos, batch.mask)
    used = batch.weights.flatten() > 0  # lm_head only where there is a label (the big matmul)
    logits = drafter.logits(hidden.flatten(0, 1)[used]).float()  # [used, vocab]
    labels, weights = batch.labels.flatten()[used], batch.weights.flatten()[used]
    ce = F.cross_entropy(logits, labels, reduction="none")
    loss = (ce * weights).sum() / weights.sum().clamp(min=1e-6)
    hits = torch.zeros_like(used)
    hits[used] = logits.argmax(-1) == labels
    return loss, hits.view_as(batch.labels)


def acceptance_estimate(hits: torch.Tensor, weights: torch.Tensor, block_size: int) -> float:
    """Mean 1 + leading hits over full-length blocks (what greedy verify would accept)."""
    hits = hits.view(-1, block_size)[:, 1:]
    full = (weights.view(-1, block_size)[:, 1:] > 0).all(1)
    if not bool(full.any()):
        return float("nan")
    leading = torch.cumprod(hits[full].long(), dim=1).sum(1)
    return 1.0 + float(leading.float().mean())


def train_drafter(
    target_dir: Path, data: DistillData, out_dir: Path, run_dir: Path, cfg: DrafterTrainConfig
) -> None:
    tok = load_tokenizer(target_dir)
    target = load_target(target_dir).requires_grad_(False)
    torch.manual_seed(cfg.loop.seed)
    drafter = build_drafter(target, token_id(tok, MASK), cfg)
    if cfg.dflash2 is not None:
        drafter = to_dflash2(drafter, target, cfg.dflash2, cfg.loop.seed)
    n_params = sum(p.numel() for p in drafter.parameters())
    print(f"drafter: {n_params / 1e6:.2f} M params, {data.tokens.shape[0]} sequences")
    features = data.features

    def step_fn(step: int, gen: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        rows = torch.randint(0, data.tokens.shape[0], (cfg.batch_seqs,), generator=gen)
        tokens, lengths = data.tokens[rows], data.lengths[rows]
        anchors = sample_anchors(lengths, data.prompt_len, cfg.blocks, gen)
        batch = build_blocks(tokens, lengths, anchors, drafter.mask_token_id, cfg.blocks, gen)
        metrics: dict[str, float] = {}
        if isinstance(drafter, DFlash2Drafter):
            size = cfg.blocks.block_size
            loss, hits, metrics = dflash2_loss(
                drafter, features[rows].float(), batch, size, cfg.selector_weight
            )
        else:
            loss, hits = block_loss(drafter, features[rows].float(), batch)
        tau = acceptance_estimate(hits, batch.weights, cfg.blocks.block_size)
        return loss, {"loss": float(loss.detach()), "tau": tau, **metrics}

    train_loop(drafter, step_fn, cfg.loop, run_dir, "drafter")
    save_compact(drafter, out_dir)
    print(f"drafter: saved -> {out_dir}")


def save_compact(drafter: DFlashDrafter, out_dir: Path) -> None:
    """DFlash layout via the engine's saver, weights stored as bf16; served in float32 (see
    engine.train.target.save_target)."""
    drafter.to(torch.bfloat16)
    save_drafter(drafter, out_dir)
    drafter.to(torch.float32)
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["torch_dtype"] = SERVING_DTYPE
    config_path.write_text(json.dumps(config, indent=2) + "\n")
