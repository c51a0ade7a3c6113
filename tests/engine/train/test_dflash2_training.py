"""The recipe's DFlash2 pieces: the init is DFlash at step 0, blocks side by side convolve
as separate blocks, the teacher-forced scores are the walk's edge scores, and the loss
trains every DFlash2 weight."""

from __future__ import annotations

import torch

from engine.dflash2 import DFlash2Drafter
from engine.drafter import DFlashDrafter
from engine.train.blocks import BlockBatch, BlockConfig, build_blocks, sample_anchors
from engine.train.dflash2_training import (
    SMOKE_DFLASH2,
    dflash2_loss,
    predecessors,
    teacher_forced_scores,
    to_dflash2,
)
from engine.train.drafter_training import block_loss
from tests.fixtures.tiny_dflash2 import near_identity
from tests.fixtures.tiny_models import random_drafter, random_target, tiny_target_config

BLOCKS = BlockConfig(block_size=4, anchors_per_seq=3, gamma=2.0, lengths=(2, 4))


def _pair() -> tuple[DFlashDrafter, DFlash2Drafter, torch.Tensor, BlockBatch]:
    target = random_target(tiny_target_config(64, 2, False))
    base = random_drafter(target, block_size=4)
    drafter = to_dflash2(base, target, SMOKE_DFLASH2, seed=0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 60, (2, 20), generator=gen)
    lengths = torch.tensor([20, 15])
    anchors = sample_anchors(lengths, 6, BLOCKS, gen)
    batch = build_blocks(tokens, lengths, anchors, base.mask_token_id, BLOCKS, gen)
    features = torch.randn(2, 20, 32, generator=gen)  # one target layer (the middle one)
    return base, drafter, features, batch


def test_step_zero_is_dflash() -> None:
    base, drafter, features, batch = _pair()
    dflash, _ = block_loss(base, features, batch)
    _, hits, metrics = dflash2_loss(drafter, features, batch, 4, selector_weight=1.0)
    assert abs(metrics["block_loss"] - float(dflash.detach())) < 1e-5
    # zero successor codebook: the selector's choice is the argmax, so its hits are DFlash's
    _, dflash_hits = block_loss(base, features, batch)
    assert torch.equal(hits, dflash_hits)


def test_blocks_side_by_side_convolve_alone() -> None:
    """A row of n blocks (training) == each block on its own (serving), with a trained-like
    (non-identity) convolution."""
    _, drafter, features, _ = _pair()
    near_identity(drafter, conv=0.3)
    ids = torch.randint(0, 60, (1, 8))
    positions = torch.tensor([[6, 7, 8, 9, 10, 11, 12, 13]])
    ctx = torch.arange(6)[None]
    mask = torch.zeros(1, 1, 8, 6 + 8, dtype=torch.bool)
    mask[..., :6] = True
    mask[:, :, :4, 6:10] = True
    mask[:, :, 4:, 10:] = True
    both = drafter(ids, positions, features[:1, :6], ctx, mask, block_size=4)
    for j in range(2):
        part = slice(4 * j, 4 * j + 4)
        one = drafter(ids[:, part], positions[:, part], features[:1, :6], ctx)
        assert torch.allclose(both[:, part], one, atol=1e-5)


def test_teacher_forced_scores_are_the_walks_edges() -> None:
    _, drafter, _, _ = _pair()
    near_identity(drafter)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 3, 32, generator=gen)
    anchors = torch.tensor([5])
    ids, edges = drafter.candidate_scores(anchors, torch.cat([hidden[:, :1], hidden], 1))
    logits = drafter.logits(hidden[0]).float()
    # row 0 after the anchor; row 2 after candidate 1 of row 1
    got_ids, scores = teacher_forced_scores(drafter, hidden[0], logits, torch.tensor([5, 0, 0]))
    assert torch.equal(got_ids, ids[0])
    assert torch.allclose(scores[0], edges[0, 0, 0], atol=1e-5)
    _, scores = teacher_forced_scores(drafter, hidden[0], logits, ids[0, 1, 1].repeat(3))
    assert torch.allclose(scores[2], edges[0, 2, 1], atol=1e-5)


def test_predecessors_are_the_previous_true_tokens() -> None:
    _, _, _, batch = _pair()
    prev = predecessors(batch, 4).view(2, -1, 4)
    labels = batch.labels.view(2, -1, 4)
    anchors = batch.block_ids.view(2, -1, 4)[:, :, 0]
    assert torch.equal(prev[:, :, 1], anchors)
    assert torch.equal(prev[:, :, 2:], labels[:, :, 1:-1])


def test_loss_trains_every_dflash2_weight() -> None:
    _, drafter, features, batch = _pair()
    loss, _, metrics = dflash2_loss(drafter, features, batch, 4, selector_weight=1.0)
    loss.backward()  # type: ignore[no-untyped-call]
    assert metrics["selector_loss"] > 0 and 0 < metrics["in_top_k"] <= 1
    for name, param in drafter.named_parameters():
        if "conv" in name or "candidate_selector" in name:
            assert param.grad is not None, name
    selector = drafter.candidate_selector
    assert selector.successor_codebook.grad is not None
    assert float(selector.successor_codebook.grad.abs().sum()) > 0
    assert float(drafter.layers[0].attention_conv.kernel_projection.weight.grad.abs().sum()) > 0  # type: ignore[union-attr, index]
