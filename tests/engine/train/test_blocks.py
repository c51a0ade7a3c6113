"""DFlash training blocks: the block attention mask, labels and decayed weights."""

from __future__ import annotations

import math

import torch

from engine.train.blocks import BlockConfig, build_blocks, sample_anchors

MASK_ID = 3


def _batch(lengths: tuple[int, ...] = (8, 8)) -> tuple[torch.Tensor, BlockConfig]:
    cfg = BlockConfig(block_size=4, anchors_per_seq=2, gamma=2.0, lengths=(4,))
    tokens = torch.arange(100, 112).repeat(len(lengths), 1)  # [b, 12], token = 100 + position
    return tokens, cfg


def test_block_mask_context_before_anchor_and_own_block_only() -> None:
    tokens, cfg = _batch()
    anchors = torch.tensor([[5, 2], [3, 7]])
    lengths = torch.tensor([12, 12])
    batch = build_blocks(tokens, lengths, anchors, MASK_ID, cfg, torch.Generator().manual_seed(0))
    seq_len, size = tokens.shape[1], cfg.block_size
    assert batch.mask.shape == (2, 1, 2 * size, seq_len + 2 * size)
    for row in range(2):
        for j, a in enumerate(anchors[row].tolist()):
            for q in range(j * size, (j + 1) * size):
                visible = batch.mask[row, 0, q]
                assert visible[:seq_len].tolist() == [k < a for k in range(seq_len)]
                own = [seq_len + j * size + i for i in range(size)]
                assert visible[seq_len:].nonzero().flatten().add(seq_len).tolist() == own


def test_block_ids_positions_labels_and_weights() -> None:
    tokens, cfg = _batch()
    anchors = torch.tensor([[5, 2], [3, 7]])
    lengths = torch.tensor([12, 9])  # second row: tokens from position 9 on are not valid
    batch = build_blocks(tokens, lengths, anchors, MASK_ID, cfg, torch.Generator().manual_seed(0))
    assert batch.block_ids[0].tolist() == [
        105,
        MASK_ID,
        MASK_ID,
        MASK_ID,
        102,
        MASK_ID,
        MASK_ID,
        MASK_ID,
    ]
    assert batch.positions[0].tolist() == [5, 6, 7, 8, 2, 3, 4, 5]
    assert batch.labels[0].tolist() == [0, 106, 107, 108, 0, 103, 104, 105]
    w = [0.0, 1.0, math.exp(-0.5), math.exp(-1.0)]
    assert torch.allclose(batch.weights[0], torch.tensor(w + w))
    # anchor 7 in a row of 9 valid tokens: only position 8 has a label
    assert batch.labels[1, 4:].tolist() == [0, 108, 0, 0]
    assert batch.weights[1, 4:].tolist() == [0.0, 1.0, 0.0, 0.0]


def test_shorter_effective_blocks_hide_their_tail() -> None:
    tokens, _ = _batch()
    cfg = BlockConfig(block_size=4, anchors_per_seq=1, gamma=2.0, lengths=(2,))
    anchors = torch.tensor([[4], [4]])
    batch = build_blocks(
        tokens, torch.tensor([12, 12]), anchors, MASK_ID, cfg, torch.Generator().manual_seed(0)
    )
    seq_len = tokens.shape[1]
    assert batch.weights[0].gt(0).tolist() == [False, True, False, False]
    for q in range(4):  # every query sees only the first two block slots
        assert batch.mask[0, 0, q, seq_len:].tolist() == [True, True, False, False]


def test_anchors_fall_in_the_generated_part() -> None:
    cfg = BlockConfig(block_size=4, anchors_per_seq=64)
    lengths = torch.tensor([20, 11])
    anchors = sample_anchors(lengths, 10, cfg, torch.Generator().manual_seed(0))
    assert anchors.shape == (2, 64)
    assert int(anchors.min()) >= 10
    assert int(anchors[0].max()) <= 18 and int(anchors[1].max()) == 10
