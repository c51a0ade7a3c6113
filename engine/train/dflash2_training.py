"""The recipe's DFlash2 drafter (`dflash-train drafter --arch dflash2`): its settings, its
initialisation and its loss.

Initialisation equals DFlash's (draft layers copied from the target's last layers, the same
seed for `fc`), and every addition starts as a no-op: each GroupedConv is the identity, and
the selector's successor codebook is zero, so every edge score is the unary logit and the
greedy walk is DFlash's argmax. Step 0 is DFlash exactly. The predecessor codebook starts
random instead of zero: the pairwise term is bilinear in the two codebooks, so with both at
zero neither would ever get a gradient.

Loss = DFlash's block loss on the drafter's logits + `selector_weight` * selector loss.
Selector loss, teacher-forced: at each labelled block row, the candidates are the top-K of
that row's logits and the predecessor is the TRUE previous token (the anchor at the first
mask row). Cross-entropy over the K edge scores toward the true token, on rows where it is
among the candidates (elsewhere the walk cannot draft it whatever the selector does; the
block loss is what lifts it into the top K), weighted like the block loss. Teacher forcing
is exact for what acceptance needs: a row's draft only counts if every earlier draft was the
true token, and then the walk's predecessor IS the true token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.dflash2 import DFlash2Config, DFlash2Drafter, top_candidates
from engine.drafter import DFlashDrafter
from engine.layers import linear
from engine.model import Qwen3Target
from engine.train.blocks import BlockBatch

# For the tiny target (hidden 256, vocab 4096, blocks of 16); why each, docs/training.md.
RECIPE_DFLASH2 = DFlash2Config(
    conv_kernel_size=4,  # each row mixes in itself and the 3 rows before it in the block
    conv_group_size=32,  # 8 groups of 32 channels share a per-token tap offset
    selector_rank=32,  # 2 x 4096 x 32 codebook weights: +0.5 MB in bf16
    selector_top_k=8,
)
# Smoke runs (targets of any width that 8 divides; vocabularies of at least 4 tokens).
SMOKE_DFLASH2 = DFlash2Config(
    conv_kernel_size=2, conv_group_size=8, selector_rank=4, selector_top_k=4
)
# Scale of the predecessor codebook's random start (the successor one starts at zero).
PREDECESSOR_INIT_STD = 0.02


def to_dflash2(
    drafter: DFlashDrafter, target: Qwen3Target, extra: DFlash2Config, seed: int
) -> DFlash2Drafter:
    """A DFlash2 drafter holding `drafter`'s weights (its layers, fc and norms), the
    convolutions at identity and the selector at no-op. `seed` draws the predecessor
    codebook from its own generator, so the global stream (and so everything else the
    recipe draws) is the same as for DFlash."""
    out = DFlash2Drafter(drafter.config, extra, target.model.embed_tokens, target.lm_head)
    missing, unexpected = out.load_state_dict(drafter.state_dict(), strict=False)
    added = ("attention_conv.", "mlp_conv.", "candidate_selector.")
    if unexpected or any(not any(part in key for part in added) for key in missing):
        raise ValueError(f"DFlash2 init: missing {missing[:3]}, unexpected {unexpected[:3]}")
    gen = torch.Generator().manual_seed(seed)
    codebook = out.candidate_selector.predecessor_codebook
    with torch.no_grad():
        codebook.copy_(torch.randn(codebook.shape, generator=gen) * PREDECESSOR_INIT_STD)
    return out


def teacher_forced_scores(
    drafter: DFlash2Drafter, hidden: Tensor, logits: Tensor, previous: Tensor
) -> tuple[Tensor, Tensor]:
    """Rows hidden [N, H] with logits [N, V] and their true predecessors [N] -> (candidate
    ids [N, K], edge scores [N, K]): engine.dflash2.edge_scores with the predecessor given
    as a token, not as one of the previous row's candidates."""
    extra = drafter.dflash2
    ids, unary = top_candidates(
        logits, extra.selector_top_k, extra.output_multiplier, extra.final_logit_softcapping
    )
    selector = drafter.candidate_selector
    h = linear(selector.hidden_projection, hidden).float()  # [N, R]
    left = selector.predecessor_codebook.float()[previous] * h  # [N, R]
    right = selector.successor_codebook.float()[ids]  # [N, K, R]
    return ids, unary + torch.einsum("nr,nkr->nk", left, right)


def predecessors(batch: BlockBatch, block_size: int) -> Tensor:
    """[b, n*B]: the true token before each slot's label (the anchor at slot 1; slot 0,
    never labelled, gets the anchor too)."""
    b = batch.labels.shape[0]
    tokens = batch.labels.view(b, -1, block_size).clone()
    tokens[:, :, 0] = batch.block_ids.view(b, -1, block_size)[:, :, 0]
    previous = torch.cat([tokens[:, :, :1], tokens[:, :, :-1]], dim=2)
    return previous.view_as(batch.labels)


def dflash2_loss(
    drafter: DFlash2Drafter,
    features: Tensor,
    batch: BlockBatch,
    block_size: int,
    selector_weight: float,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """(block loss + selector_weight * selector loss, per-slot hits of the selector's
    teacher-forced choice [b, n*B], metrics)."""
    b, seq_len, _ = features.shape
    ctx_pos = torch.arange(seq_len, device=features.device).expand(b, seq_len)
    hidden = drafter(
        batch.block_ids, batch.positions, features, ctx_pos, batch.mask, block_size=block_size
    )
    used = batch.weights.flatten() > 0
    rows = hidden.flatten(0, 1)[used]
    logits = drafter.logits(rows).float()
    labels, weights = batch.labels.flatten()[used], batch.weights.flatten()[used]
    ce = F.cross_entropy(logits, labels, reduction="none")
    block = (ce * weights).sum() / weights.sum().clamp(min=1e-6)

    previous = predecessors(batch, block_size).flatten()[used]
    ids, scores = teacher_forced_scores(drafter, rows, logits, previous)
    is_label = ids == labels[:, None]  # [N, K]
    present = is_label.any(1)
    target = is_label.float().argmax(1)
    sel_ce = F.cross_entropy(scores[present], target[present], reduction="none")
    sel_w = weights[present]
    selector = (sel_ce * sel_w).sum() / sel_w.sum().clamp(min=1e-6)

    hits = torch.zeros_like(used)
    hits[used] = present & (scores.argmax(1) == target)
    metrics = {
        "block_loss": float(block.detach()),
        "selector_loss": float(selector.detach()),
        "in_top_k": float(present.float().mean()) if present.numel() else float("nan"),
    }
    return block + selector_weight * selector, hits.view_as(batch.labels), metrics
