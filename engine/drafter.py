"""DFlash block-diffusion drafter (public `DFlashDraftModel` layout, as vLLM reads it).

Context features: the target's hidden states at `target_layer_ids` (output of layer i),
concatenated, projected by `fc` and normed by `hidden_norm`. In every draft layer they
become extra keys/values: k = k_norm(k_proj(ctx)) rotated at the context positions,
v = v_proj(ctx) (no input_layernorm on the context). The block [last, MASK, ...] is
embedded with the target's `embed_tokens`, runs through pre-norm layers whose queries
attend NON-causally to (context ; block), then `norm`, then the target's `lm_head`.
Inference keeps the context K/V in a slot cache, so each step only adds new context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from engine.kv_cache import CacheIndex, KVCache
from engine.layers import (
    DecoderLayer,
    FusedWeight,
    LayerShape,
    RMSNorm,
    Rotary,
    linear,
    use_int8_matmuls,
)
from engine.model import rope_theta_of
from engine.sampling import greedy


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's default: the middle layer for one draft layer, else evenly spread
    from layer 1 to layer L-3 (one target layer per draft layer)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    step = (last - first) / (num_draft_layers - 1)
    return [round(first + i * step) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    mask_token_id: int
    block_size: int = 16
    target_layer_ids: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768

    def __post_init__(self) -> None:
        if not self.target_layer_ids:  # frozen: fill the default through object.__setattr__
            ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
            object.__setattr__(self, "target_layer_ids", ids)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DrafterConfig:
        extra = raw.get("dflash_config") or {}
        heads = int(raw["num_attention_heads"])
        return cls(
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
            vocab_size=int(raw["vocab_size"]),
            num_target_layers=int(raw["num_target_layers"]),
            mask_token_id=int(extra.get("mask_token_id", raw.get("mask_token_id", -1))),
            block_size=int(raw.get("block_size", extra.get("block_size", 16))),
            target_layer_ids=list(extra.get("target_layer_ids") or []),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta_of(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json in the public DFlash layout (vLLM: DFlashQwen3ForCausalLM)."""
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
        }

    def layer_shape(self) -> LayerShape:
        return LayerShape(
            self.hidden_size,
            self.intermediate_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
            self.rms_norm_eps,
        )


# (layer index, layer) -> context (k, v) each [b, kv_heads, c, d], and the bool mask over them
ContextKV = Callable[[int, DecoderLayer], tuple[Tensor, Tensor]]


class DFlashDrafter(nn.Module):
    """Own weights: layers.N.*, fc, hidden_norm, norm. Borrowed: embed_tokens, lm_head."""

    kind = "DFlash"  # as logs name it

    def __init__(
        self, config: DrafterConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear
    ) -> None:
        super().__init__()
        self.config = config
        shape = config.layer_shape()
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(config.num_hidden_layers))
        n_features = len(config.target_layer_ids) * config.hidden_size
        self.fc = nn.Linear(n_features, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config.head_dim, config.rope_theta)
        # A tuple keeps the target's modules out of this module's parameters/state_dict.
        self._borrowed = (embed_tokens, lm_head)
        self._int8_head: FusedWeight | None = None  # the borrowed lm_head in int8 (use_int8)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def draft_layers(self) -> list[DecoderLayer]:
        return [layer for layer in self.layers if isinstance(layer, DecoderLayer)]

    @property
    def dtype(self) -> torch.dtype:
        """The drafter's compute dtype. It may differ from the target's (e.g. bfloat16
        drafting for a float32 target: drafts only propose, so exactness is unaffected);
        the borrowed embedding and lm_head are then used in this dtype."""
        return self.fc.weight.dtype

    def embed(self, ids: Tensor) -> Tensor:
        return self._borrowed[0](ids).to(self.dtype)  # type: ignore[no-any-return]

    def use_int8(self) -> None:
        """Draft with int8 matmuls (layers.use_int8_matmuls), the borrowed lm_head
        included through a copy of its own, so the target keeps its float32 head."""
        use_int8_matmuls(self)
        self._int8_head = FusedWeight(int8=True)

    @property
    def int8(self) -> bool:
        return self._int8_head is not None

    def logits(self, hidden: Tensor) -> Tensor:
        """Draft logits [.., vocab] from drafter hidden states [.., hidden]."""
        if self._int8_head is not None:
            return self._int8_head.linear(hidden, [self._borrowed[1].weight])
        return linear(self._borrowed[1], hidden)

    def propose(self, anchors: Tensor, hidden: Tensor) -> Tensor:
        """Draft ids [b, B-1]: the argmax at each mask row of hidden [b, B, hidden]. The
        anchors [b] (the blocks' first tokens) matter to DFlash2's selector, not here."""
        return greedy(self.logits(hidden[:, 1:]))

    def context(self, features: Tensor) -> Tensor:
        """Concatenated target hidden states [b, c, n*hidden] -> context [b, c, hidden]."""
        return self.hidden_norm(linear(self.fc, features.to(self.dtype)))  # type: ignore[no-any-return]

    def forward(
        self,
        block_ids: Tensor,
        block_positions: Tensor,
        features: Tensor,
        context_positions: Tensor,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        """Cache-free forward (training, tests). block_ids/positions [b, B], features
        [b, c, n*hidden], context_positions [b, c]; attn_mask bool [b, 1, B, c + B]
        (default: everything visible). Returns hidden states after `norm`, [b, B, hidden]."""
        context_kv = self.context_kv(features, context_positions)
        return self._blocks(block_ids, block_positions, context_kv, attn_mask)

    def context_kv(self, features: Tensor, context_positions: Tensor) -> ContextKV:
        """Every layer's context K/V from features [b, c, n*hidden] (cache-free forward)."""
        ctx = self.context(features)
        cos, sin = self.rotary.cos_sin(context_positions, ctx.dtype)

        def context_kv(_: int, layer: DecoderLayer) -> tuple[Tensor, Tensor]:
            return layer.self_attn.key_value(ctx, cos, sin)

        return context_kv

    def _blocks(
        self, block_ids: Tensor, block_positions: Tensor, context_kv: ContextKV, mask: Tensor | None
    ) -> Tensor:
        x = self.embed(block_ids)
        cos, sin = self.rotary.cos_sin(block_positions, x.dtype)
        for i, layer in enumerate(self.draft_layers()):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.query(h, cos, sin)
            k, v = attn.key_value(h, cos, sin)
            ctx_k, ctx_v = context_kv(i, layer)
            k = torch.cat([ctx_k, k], dim=2)  # [b, kv_h, c + B, d]
            v = torch.cat([ctx_v, v], dim=2)
            x = layer.feed_forward(x + attn.attend(q, k, v, mask))
        return self.norm(x)  # type: ignore[no-any-return]

    # ---- inference with a slot cache of context K/V -------------------------------------

    def new_cache(
        self, num_slots: int, capacity: int, device: torch.device | str, dtype: torch.dtype
    ) -> KVCache:
        return KVCache.for_model(self.config, num_slots, capacity, device, dtype)

    def append_context(
        self,
        features: Tensor,
        positions: Tensor,
        valid: Tensor | None,
        cache: KVCache,
        slots: Tensor,
        index: CacheIndex | None = None,
        max_position: int | None = None,
    ) -> None:
        """Project target features [b, t, n*hidden] at positions [b, t] into every draft
        layer's context K/V and store the valid ones (None: all) in rows `slots` [b] of
        `cache`. Callers that already have it pass the write `index`."""
        ctx = self.context(features)
        cos, sin = self.rotary.cos_sin(positions, ctx.dtype, max_position)
        if index is None:
            index = CacheIndex.build(
                slots.tolist(), positions[:, 0].tolist(), positions, valid, positions.device
            )
        for i, layer in enumerate(self.draft_layers()):
            k, v = layer.self_attn.project_kv(ctx, cos, sin)
            cache.write_at(i, index, k, v)

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
        """One forward for all rows: block [b, B] attends to the row's cached context
        (positions < context_lengths[b]) and the whole block. Returns [b, B, hidden].

        The block's own K/V are written into the cache right after the row's context
        (positions past the committed length are dead: the next commit overwrites them),
        so every row's keys are the prefix [0, length + B) of its cache row: no
        concatenation, and reads are views when the slots are consecutive."""
        hosts = context_lengths.tolist() if lengths is None else lengths
        size = block_ids.shape[1]
        if index is None:
            index = CacheIndex.build(slots.tolist(), hosts, block_positions, None, block_ids.device)
        kv_len = max(hosts) + size
        mask = None
        if min(hosts) != max(hosts):
            keys = torch.arange(kv_len, device=block_ids.device)
            visible = keys[None, :] < (context_lengths[:, None] + size)  # [b, kv_len]
            mask = visible[:, None, None, :]  # [b, 1, 1, kv_len], same for every query
        x = self.embed(block_ids)
        cos, sin = self.rotary.cos_sin(block_positions, x.dtype, kv_len - 1)
        for i, layer in enumerate(self.draft_layers()):
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm(x), cos, sin)
            cache.write_at(i, index, k, v)
            ck, cv = cache.read_at(i, index, kv_len)
            x = layer.feed_forward(x + attn.attend(q, ck, cv, mask))
        return self.norm(x)  # type: ignore[no-any-return]
