"""Qwen3 target model in the Hugging Face key layout, with slot KV caches.

`forward` runs a padded batch of rows, each at its own positions, on top of (or without)
the slot caches, and returns logits plus the raw outputs of requested decoder layers, which
DFlash turns into context features (as vLLM reads them). Transformers' `hidden_states[i + 1]`
is the same tensor for every layer but the last, which transformers returns after the final
norm: a layer id equal to num_layers - 1 is the raw output here, not that normed tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from engine.kv_cache import CacheIndex, KVCache
from engine.layers import DecoderLayer, LayerShape, RMSNorm, Rotary, linear


def rope_theta_of(raw: dict[str, Any], default: float = 1_000_000.0) -> float:
    """rope_theta from a config dict: top-level (transformers 4) or rope_parameters (5)."""
    params = raw.get("rope_parameters") or {}
    return float(raw.get("rope_theta") or params.get("rope_theta") or default)


@dataclass(frozen=True)
class TargetConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    attention_bias: bool = False

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TargetConfig:
        heads = int(raw["num_attention_heads"])
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta_of(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            attention_bias=bool(raw.get("attention_bias", False)),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json content as transformers writes it for Qwen3ForCausalLM."""
        out: dict[str, Any] = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
        out.update(asdict(self))
        out.update(
            hidden_act="silu",
            torch_dtype="float32",
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
        )
        return out

    def layer_shape(self) -> LayerShape:
        return LayerShape(
            self.hidden_size,
            self.intermediate_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
            self.rms_norm_eps,
            self.attention_bias,
        )


@dataclass
class TargetOutput:
    logits: Tensor  # [b, t, vocab]
    hidden: Tensor | None  # [b, t, len(layer_ids) * hidden] (concatenated), None if no ids


class Qwen3Body(nn.Module):
    """Holds `model.*` weights (embed_tokens, layers, norm) under HF names."""

    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        shape = config.layer_shape()
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3Target(nn.Module):
    """Qwen3ForCausalLM equivalent; state_dict keys equal the HF checkpoint's."""

    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(config.head_dim, config.rope_theta)

    def new_cache(
        self, num_slots: int, capacity: int, device: torch.device | str, dtype: torch.dtype
    ) -> KVCache:
        return KVCache.for_model(self.config, num_slots, capacity, device, dtype)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        valid: Tensor | None = None,
        cache: KVCache | None = None,
        slots: Tensor | None = None,
        layer_ids: Sequence[int] = (),
        logit_index: Tensor | None = None,
        index: CacheIndex | None = None,
        kv_len: int | None = None,
    ) -> TargetOutput:
        """input_ids/positions/valid [b, t]. With a cache, rows `slots` [b] attend to their
        cached prefix and new K/V are written at `positions`; padded (invalid) tokens are
        neither written nor meaningful. Without a cache, attention is causal by position.
        `logit_index` [b, k] limits logits to those token indices (prefill: the last one).
        Callers that know them pass `index` (where to read/write, built once) and `kv_len`
        (keys to attend to = highest valid position + 1) to spare per-call host reads."""
        x = self.model.embed_tokens(input_ids)
        if cache is not None and index is None:
            assert slots is not None, "slots are required with a cache"
            starts = positions[:, 0].tolist()
            index = CacheIndex.build(slots.tolist(), starts, positions, valid, positions.device)
        if cache is not None and kv_len is None:
            kv_len = _highest(positions, valid) + 1
        cos, sin = self.rotary.cos_sin(positions, x.dtype, None if kv_len is None else kv_len - 1)
        mask = self._mask(positions, valid, kv_len)
        wanted = {i: n for n, i in enumerate(layer_ids)}
        collected: list[Tensor | None] = [None] * len(layer_ids)
        for i, layer in enumerate(self.model.layers):
            assert isinstance(layer, DecoderLayer)
            x = self._layer(layer, i, x, cos, sin, mask, cache, index, kv_len)
            if i in wanted:
                collected[wanted[i]] = x
        if logit_index is not None:  # [b, t, hidden] -> [b, k, hidden]
            x = x.gather(1, logit_index[:, :, None].expand(-1, -1, x.shape[-1]))
        logits = linear(self.lm_head, self.model.norm(x))
        hidden = torch.cat([h for h in collected if h is not None], dim=-1) if layer_ids else None
        return TargetOutput(logits=logits, hidden=hidden)

    def _layer(
        self,
        layer: DecoderLayer,
        index: int,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        cache: KVCache | None,
        where: CacheIndex | None,
        kv_len: int | None,
    ) -> Tensor:
        attn = layer.self_attn
        q, k, v = attn.project(layer.input_layernorm(x), cos, sin)
        if cache is not None:
            assert where is not None and kv_len is not None
            cache.write_at(index, where, k, v)
            k, v = cache.read_at(index, where, kv_len)
        x = x + attn.attend(q, k, v, mask)
        return layer.feed_forward(x)

    @staticmethod
    def _mask(positions: Tensor, valid: Tensor | None, kv_len: int | None) -> Tensor | None:
        """Boolean attention mask [b, 1, t, keys] (None: every key visible to every query);
        every query sees at least one key. kv_len set = on top of a cache."""
        if kv_len is not None:
            if positions.shape == (1, 1):
                return None  # one query at the last position sees every cached key
            keys = torch.arange(kv_len, device=positions.device)
            mask = keys[None, None, :] <= positions[:, :, None]  # [b, t, kv_len]
        else:
            if valid is None:
                valid = torch.ones_like(positions, dtype=torch.bool)
            causal = positions[:, None, :] <= positions[:, :, None]  # [b, t(q), t(k)]
            mask = causal & valid[:, None, :]
            eye = torch.eye(positions.shape[1], dtype=torch.bool, device=positions.device)
            mask = mask | eye  # padded queries attend to themselves (never NaN)
        return mask[:, None]


def _highest(positions: Tensor, valid: Tensor | None) -> int:
    """The highest valid position (one host read)."""
    return int((positions if valid is None else positions.masked_fill(~valid, 0)).max())
