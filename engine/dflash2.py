"""DFlash2 drafter: DFlash plus a causal grouped convolution around each sublayer and a
low-rank candidate selector (the `DFlash2DraftModel` layout vLLM 0.33 reads).

Convolution (per layer, one for the attention and one for the MLP): `prepare` runs on the
sublayer's normed input, `finish` on the sublayer's output before the residual add. Along
the block (position t = 0..B-1 of a row), depthwise, groups of `conv_group_size` channels
share a per-token delta predicted from the normed input:
    out[t, c] = sum_{k <= t} (base[side, k, c] + delta[t, k, group(c)]) * x[t - k, c]
Only the block's own tokens pass through it: the context K/V injected from the target are
projected as in DFlash, unconvolved.

Selector: the lm_head's top-K tokens at each mask row are its candidates, their logits
(times output_multiplier, then soft-capped) the unary scores; an edge from candidate p at
row l-1 (the anchor, the block's first token, for l = 0) to candidate c at row l adds
    sum_r P[prev, r] * h[l, r] * S[cand c, r],   h = hidden_projection(hidden[l]).
A greedy walk from the anchor takes the best edge at each row: ONE linear draft, verified
by the usual rule (engine/speculative.py), so outputs stay the target's exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.drafter import ContextKV, DFlashDrafter, DrafterConfig
from engine.kv_cache import CacheIndex, KVCache
from engine.layers import DecoderLayer, linear

ARCHITECTURE = "DFlash2DraftModel"


@dataclass(frozen=True)
class DFlash2Config:
    """The `dflash_config` keys DFlash2 adds to DFlash's."""

    conv_kernel_size: int  # taps T
    conv_group_size: int  # channels per group; groups G = hidden / group size
    selector_rank: int  # R
    selector_top_k: int  # K candidates per mask row
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0  # on the K candidate logits only (as vLLM)
    final_logit_softcapping: float = 0.0  # <= 0: none

    @classmethod
    def from_dict(cls, extra: dict[str, Any]) -> DFlash2Config:
        """From `dflash_config`; KeyError names a missing key."""
        return cls(
            conv_kernel_size=int(extra["conv_kernel_size"]),
            conv_group_size=int(extra["conv_group_size"]),
            selector_rank=int(extra["selector_rank"]),
            selector_top_k=int(extra["selector_top_k"]),
            input_embedding_scale=float(extra.get("input_embedding_scale", 1.0)),
            output_multiplier=float(extra.get("output_multiplier", 1.0)),
            final_logit_softcapping=float(extra.get("final_logit_softcapping") or 0.0),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "conv_kernel_size": self.conv_kernel_size,
            "conv_group_size": self.conv_group_size,
            "selector_rank": self.selector_rank,
            "selector_top_k": self.selector_top_k,
            "input_embedding_scale": self.input_embedding_scale,
            "output_multiplier": self.output_multiplier,
            "final_logit_softcapping": self.final_logit_softcapping,
        }

    def problems(self, hidden_size: int, vocab_size: int) -> list[str]:
        """What makes these settings unusable with this hidden size and vocabulary, each
        naming its key (empty: fine). Taps beyond the block are allowed, as in vLLM: they
        never reach a row (a tap k only reads rows t >= k)."""
        out = []
        if self.conv_kernel_size < 1:
            out.append(f"dflash_config.conv_kernel_size {self.conv_kernel_size} must be >= 1")
        if self.conv_group_size < 1 or hidden_size % self.conv_group_size:
            out.append(
                f"dflash_config.conv_group_size {self.conv_group_size} does not divide "
                f"hidden_size {hidden_size}"
            )
        if self.selector_rank < 1:
            out.append(f"dflash_config.selector_rank {self.selector_rank} must be >= 1")
        if not 1 <= self.selector_top_k <= vocab_size:
            out.append(
                f"dflash_config.selector_top_k {self.selector_top_k} must be in [1, {vocab_size}]"
            )
        return out


def grouped_conv(x: Tensor, delta: Tensor, base: Tensor) -> Tensor:
    """Causal grouped convolution along each row's block.

    x [b, B, H]; delta [b, B, T, G] (per-token, per-group tap offsets); base [T, H].
    out[:, t] = sum_{k <= t} (base[k] + delta[:, t, k, group]) * x[:, t - k] -> [b, B, H]."""
    b, size, hidden = x.shape
    taps, groups = delta.shape[-2:]
    blocks = x.view(b, size, groups, hidden // groups)  # [b, B, G, C]
    coefficients = base.view(1, 1, taps, groups, -1) + delta[..., None]  # [b, B, T, G, C]
    out = coefficients[:, :, 0] * blocks
    for k in range(1, min(taps, size)):  # taps >= B never reach a row
        shifted = F.pad(blocks[:, : size - k], (0, 0, 0, 0, k, 0))  # row t holds x[t - k]
        out = out + coefficients[:, :, k] * shifted
    return out.view(b, size, hidden)


class GroupedConv(nn.Module):
    """base_kernel [2, T, H] (side 0: prepare, 1: finish) and kernel_projection
    [2*T*G, H], which predicts both sides' deltas from the sublayer's normed input."""

    def __init__(self, hidden_size: int, taps: int, group_size: int) -> None:
        super().__init__()
        self.taps = taps
        self.num_groups = hidden_size // group_size
        # identity until trained: tap 0 is 1, the rest and every delta 0
        base = torch.zeros(2, taps, hidden_size)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.num_groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def prepare(self, x: Tensor, block: int | None = None) -> tuple[Tensor, Tensor]:
        """x [b, B, H] (normed) -> (convolved x, the finish side's delta [b, B, T, G]).
        With `block`, each row holds consecutive blocks of that size side by side (the
        recipe trains many blocks per forward) and each is convolved on its own; the
        delta is then per block, [b * B / block, block, T, G]."""
        b, size, hidden = x.shape
        blocks = x.reshape(-1, block, hidden) if block else x
        n, length = blocks.shape[:2]
        deltas = linear(self.kernel_projection, blocks).view(
            n, length, 2, self.taps, self.num_groups
        )
        out = grouped_conv(blocks, deltas[:, :, 0], self.base_kernel[0])
        return out.view(b, size, hidden), deltas[:, :, 1]

    def finish(self, x: Tensor, delta: Tensor) -> Tensor:
        """x [b, B, H]; delta from `prepare` (its shape says how x splits into blocks)."""
        blocks = x.reshape(*delta.shape[:2], x.shape[-1])
        return grouped_conv(blocks, delta, self.base_kernel[1]).view_as(x)


class DFlash2Layer(DecoderLayer):
    """A decoder layer with `attention_conv` and `mlp_conv` around its two sublayers."""

    def __init__(self, config: DrafterConfig, extra: DFlash2Config) -> None:
        super().__init__(config.layer_shape())
        args = (config.hidden_size, extra.conv_kernel_size, extra.conv_group_size)
        self.attention_conv = GroupedConv(*args)
        self.mlp_conv = GroupedConv(*args)

    def attention_block(
        self, x: Tensor, attend: Callable[[Tensor], Tensor], block: int | None = None
    ) -> Tensor:
        """x + finish(attend(prepare(norm(x)))): `attend` maps the block's (convolved)
        normed input to the attention output; it owns the keys and values. `block`: as
        GroupedConv.prepare."""
        h, delta = self.attention_conv.prepare(self.input_layernorm(x), block)
        return x + self.attention_conv.finish(attend(h), delta)

    def feed_forward(self, x: Tensor, block: int | None = None) -> Tensor:
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x), block)
        return x + self.mlp_conv.finish(self.mlp(h), delta)


def top_candidates(
    logits: Tensor, top_k: int, multiplier: float = 1.0, softcap: float = 0.0
) -> tuple[Tensor, Tensor]:
    """logits [.., V] -> (candidate ids [.., K], unary scores [.., K]). The multiplier and
    the cap are monotone, so they touch only the K values; multiplier first, then cap, as
    vLLM's top-k head (`LogitsProcessor.get_top_k_tokens`; its full-vocabulary path caps
    first, but the selector reads the top-k one)."""
    values, ids = logits.float().topk(top_k, dim=-1)
    if multiplier != 1.0:
        values = values * multiplier
    if softcap > 0:
        values = torch.tanh(values / softcap) * softcap
    return ids, values


def edge_scores(
    predecessors: Tensor,
    successors: Tensor,
    ids: Tensor,
    unary: Tensor,
    hidden: Tensor,
    anchors: Tensor,
) -> Tensor:
    """E[b, l, p, c] = unary[b, l, c] + sum_r P[prev(b, l, p), r] * hidden[b, l, r] *
    S[ids[b, l, c], r], prev = anchors[b] at l = 0, else ids[b, l - 1, p].
    predecessors/successors [V, R]; ids/unary [b, L, K]; hidden [b, L, R]; anchors [b]."""
    b, _, k = ids.shape
    previous = torch.cat([anchors.view(b, 1, 1).expand(b, 1, k), ids[:, :-1]], dim=1)
    left = predecessors[previous] * hidden[:, :, None]  # [b, L, K(p), R]
    right = successors[ids]  # [b, L, K(c), R]
    return unary[:, :, None] + left @ right.transpose(-1, -2)  # [b, L, K(p), K(c)]


def greedy_walk(scores: Tensor, ids: Tensor) -> Tensor:
    """The path from the anchor taking the best edge at each row: scores [b, L, K, K],
    ids [b, L, K] -> token ids [b, L]. At l = 0 every row p is the anchor's (p = 0)."""
    b, steps, _ = ids.shape
    rows = torch.arange(b, device=ids.device)
    previous = torch.zeros(b, dtype=torch.long, device=ids.device)
    tokens = []
    for step in range(steps):
        previous = scores[rows, step, previous].argmax(-1)  # [b]
        tokens.append(ids[rows, step, previous])
    return torch.stack(tokens, dim=1)


class CandidateSelector(nn.Module):
    """predecessor_codebook, successor_codebook [V, R]; hidden_projection [R, H]."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def scores(self, ids: Tensor, unary: Tensor, hidden: Tensor, anchors: Tensor) -> Tensor:
        """Edge scores [b, L, K, K] (float32) for candidates ids/unary [b, L, K] at the mask
        rows' hidden states [b, L, H], after the anchors [b]."""
        h = linear(self.hidden_projection, hidden).float()  # [b, L, R]
        return edge_scores(
            self.predecessor_codebook.float(),
            self.successor_codebook.float(),
            ids,
            unary.float(),
            h,
            anchors,
        )


class DFlash2Drafter(DFlashDrafter):
    """DFlashDrafter with DFlash2Layer layers, an embedding scale and the selector's
    proposals. Own weights add layers.N.{attention,mlp}_conv.* and candidate_selector.*."""

    kind = "DFlash2"

    def __init__(
        self,
        config: DrafterConfig,
        extra: DFlash2Config,
        embed_tokens: nn.Embedding,
        lm_head: nn.Linear,
    ) -> None:
        super().__init__(config, embed_tokens, lm_head)
        self.dflash2 = extra
        self.layers = nn.ModuleList(
            DFlash2Layer(config, extra) for _ in range(config.num_hidden_layers)
        )
        self.candidate_selector = CandidateSelector(
            config.hidden_size, config.vocab_size, extra.selector_rank
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json in vLLM's DFlash2 layout."""
        raw = self.config.to_hf_dict()
        raw["architectures"] = [ARCHITECTURE]
        raw["dflash_config"] = {**raw["dflash_config"], **self.dflash2.to_dict()}
        return raw

    def dflash2_layers(self) -> list[DFlash2Layer]:
        return [layer for layer in self.layers if isinstance(layer, DFlash2Layer)]

    def embed(self, ids: Tensor) -> Tensor:
        x = super().embed(ids)
        scale = self.dflash2.input_embedding_scale
        return x if scale == 1.0 else x * scale

    def propose(self, anchors: Tensor, hidden: Tensor) -> Tensor:
        """The selector's greedy path: anchors [b] (the blocks' first tokens), hidden
        [b, B, H] -> draft ids [b, B-1]."""
        ids, scores = self.candidate_scores(anchors, hidden)
        return greedy_walk(scores, ids)

    def candidate_scores(self, anchors: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """(candidate ids [b, B-1, K], edge scores [b, B-1, K, K]) at the mask rows."""
        rows = hidden[:, 1:]
        extra = self.dflash2
        ids, unary = top_candidates(
            self.logits(rows),
            extra.selector_top_k,
            extra.output_multiplier,
            extra.final_logit_softcapping,
        )
        return ids, self.candidate_selector.scores(ids, unary, rows, anchors)

    def forward(
        self,
        block_ids: Tensor,
        block_positions: Tensor,
        features: Tensor,
        context_positions: Tensor,
        attn_mask: Tensor | None = None,
        block_size: int | None = None,
    ) -> Tensor:
        """As DFlashDrafter.forward. `block_size`: each row holds consecutive blocks of
        this size side by side (the recipe's training batches), each convolved on its own
        (default: the row is one block)."""
        context_kv = self.context_kv(features, context_positions)
        return self._blocks(block_ids, block_positions, context_kv, attn_mask, block_size)

    def _blocks(
        self,
        block_ids: Tensor,
        block_positions: Tensor,
        context_kv: ContextKV,
        mask: Tensor | None,
        block_size: int | None = None,
    ) -> Tensor:
        """The cache-free forward's layers (training, tests)."""
        x = self.embed(block_ids)
        cos, sin = self.rotary.cos_sin(block_positions, x.dtype)
        for i, layer in enumerate(self.dflash2_layers()):

            def attend(h: Tensor, i: int = i, layer: DFlash2Layer = layer) -> Tensor:
                q = layer.self_attn.query(h, cos, sin)
                k, v = layer.self_attn.key_value(h, cos, sin)
                ctx_k, ctx_v = context_kv(i, layer)
                k = torch.cat([ctx_k, k], dim=2)  # [b, kv_h, c + B, d]
                v = torch.cat([ctx_v, v], dim=2)
                return layer.self_attn.attend(q, k, v, mask)

            x = layer.feed_forward(layer.attention_block(x, attend, block_size), block_size)
        return self.norm(x)  # type: ignore[no-any-return]

    def draft_hidden(
        self,
        block_ids: Tensor,
        block_positions: Tensor,
        cache: KVCache,
        slots: Tensor,
        context_lengths: Tensor,
        index: CacheIndex | None = None,
        lengths: list[int] | None = None,
    ) -> Tensor:
        """As DFlashDrafter.draft_hidden (the block's K/V written after each row's
        context, one read per layer), with the convolutions around each sublayer."""
        hosts = context_lengths.tolist() if lengths is None else lengths
        size = block_ids.shape[1]
        if index is None:
            index = CacheIndex.build(slots.tolist(), hosts, block_positions, None, block_ids.device)
        kv_len = max(hosts) + size
        mask = _row_mask(context_lengths, hosts, size, kv_len)
        x = self.embed(block_ids)
        cos, sin = self.rotary.cos_sin(block_positions, x.dtype, kv_len - 1)
        for i, layer in enumerate(self.dflash2_layers()):

            def attend(h: Tensor, i: int = i, layer: DFlash2Layer = layer) -> Tensor:
                q, k, v = layer.self_attn.project(h, cos, sin)
                cache.write_at(i, index, k, v)
                ck, cv = cache.read_at(i, index, kv_len)
                return layer.self_attn.attend(q, ck, cv, mask)

            x = layer.feed_forward(layer.attention_block(x, attend))
        return self.norm(x)  # type: ignore[no-any-return]


def _row_mask(context_lengths: Tensor, hosts: list[int], size: int, kv_len: int) -> Tensor | None:
    """Keys each row may read when rows hold different context lengths (None: all)."""
    if min(hosts) == max(hosts):
        return None
    keys = torch.arange(kv_len, device=context_lengths.device)
    visible = keys[None, :] < (context_lengths[:, None] + size)  # [b, kv_len]
    return visible[:, None, None, :]  # [b, 1, 1, kv_len], same for every query
