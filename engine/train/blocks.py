"""DFlash training blocks: anchors, masked blocks, the block attention mask, loss weights.

For an anchor position a, the block is [x_a, MASK, ..., MASK] at positions a..a+B-1; it may
see the target's context features at positions < a (x_a itself is not yet processed by
the target at inference time) and, bidirectionally, its own block. Labels are x_{a+k} for
k = 1..B-1, weighted w_k = exp(-(k-1)/gamma): early positions matter most, because a
draft is only accepted up to its first miss.

Many blocks of one sequence train in a single drafter forward: all blocks are laid side by
side as queries, and the mask keeps each block to its own context prefix and itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockConfig:
    block_size: int = 16
    anchors_per_seq: int = 16
    gamma: float = 7.0
    # Effective block lengths trained (each block draws one): the drafter then works at
    # block sizes 4 and 8 as well as at its native block_size.
    lengths: tuple[int, ...] = (4, 8, 16, 16)


@dataclass
class BlockBatch:
    block_ids: torch.Tensor  # [b, n*B] anchor token then MASK
    positions: torch.Tensor  # [b, n*B] absolute positions a..a+B-1 per block
    mask: torch.Tensor  # [b, 1, n*B, L + n*B] bool: query may attend key
    labels: torch.Tensor  # [b, n*B] next tokens x_{a+k}; 0 where unused
    weights: torch.Tensor  # [b, n*B] loss weight; 0 for the anchor slot and unused slots

    def to(self, device: torch.device | str) -> BlockBatch:
        """The batch on `device` (blocks are built on the CPU, where the sampling is)."""
        return BlockBatch(
            self.block_ids.to(device),
            self.positions.to(device),
            self.mask.to(device),
            self.labels.to(device),
            self.weights.to(device),
        )


def sample_anchors(
    lengths: torch.Tensor,
    prompt_len: int | torch.Tensor,
    cfg: BlockConfig,
    gen: torch.Generator,
) -> torch.Tensor:
    """[b, n] anchors in the generated part, so that a + 1 < valid length of the row.
    `prompt_len`: one length for every row (the recipe's fixed-length prompts) or one per
    row [b] (captured traffic)."""
    if isinstance(prompt_len, torch.Tensor):
        lows = [int(p) for p in prompt_len.tolist()]
    else:
        lows = [prompt_len] * len(lengths)
    rows = []
    for valid, low in zip(lengths.tolist(), lows, strict=True):
        high = max(low + 1, int(valid) - 1)
        rows.append(low + torch.randint(0, high - low, (cfg.anchors_per_seq,), generator=gen))
    return torch.stack(rows)


def build_blocks(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    anchors: torch.Tensor,
    mask_id: int,
    cfg: BlockConfig,
    gen: torch.Generator,
) -> BlockBatch:
    """Blocks for `anchors` [b, n] over `tokens` [b, L] (valid prefix `lengths` [b])."""
    b, seq_len = tokens.shape
    n, size = anchors.shape[1], cfg.block_size
    k = torch.arange(size)  # in-block index
    pos = anchors[:, :, None] + k  # [b, n, B]
    choice = torch.randint(0, len(cfg.lengths), (b, n), generator=gen)
    eff = torch.tensor(cfg.lengths)[choice]  # [b, n] effective block length
    in_block = k[None, None, :] < eff[:, :, None]  # [b, n, B]
    has_label = in_block & (pos < lengths[:, None, None]) & (k > 0)
    labels = torch.gather(tokens, 1, pos.clamp(max=seq_len - 1).flatten(1)).view(b, n, size)
    block_ids = torch.full((b, n, size), mask_id, dtype=torch.long)
    block_ids[:, :, 0] = torch.gather(tokens, 1, anchors)
    decay = torch.exp(-(k - 1).clamp(min=0).float() / cfg.gamma)  # [B]
    weights = torch.where(has_label, decay, 0.0)
    return BlockBatch(
        block_ids=block_ids.flatten(1),
        positions=pos.flatten(1),
        mask=_block_mask(anchors, in_block, seq_len),
        labels=torch.where(has_label, labels, 0).flatten(1),
        weights=weights.flatten(1),
    )


def _block_mask(anchors: torch.Tensor, in_block: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[b, 1, n*B, L + n*B]: context keys before the anchor; keys of the own block that lie
    within its effective length (every query sees at least the anchor slot)."""
    b, n, size = in_block.shape
    ctx = torch.arange(seq_len)[None, None, :] < anchors[:, :, None]  # [b, n, L]
    ctx = ctx[:, :, None, :].expand(b, n, size, seq_len)  # same for every query in a block
    same = torch.eye(n, dtype=torch.bool)[None, :, None, :, None]  # [1, n(q), 1, n(k), 1]
    keys = same & in_block[:, None, None, :, :]  # [b, n, 1, n, B]
    keys = keys.expand(b, n, size, n, size).reshape(b, n, size, n * size)
    mask = torch.cat([ctx, keys], dim=-1)  # [b, n, B, L + n*B]
    return mask.reshape(b, 1, n * size, seq_len + n * size)
