"""Qwen3 building blocks shared by the target model and the DFlash drafter.

Module and parameter names follow the Hugging Face Qwen3 layout (q_proj, k_norm,
gate_proj, input_layernorm, ...) so that checkpoints load by key name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class LayerShape:
    """The per-layer sizes a Qwen3 decoder layer needs."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool = False


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as Qwen3 does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Rotary:
    """RoPE tables (non-interleaved "neox" halves, as HF Qwen3) for arbitrary positions."""

    def __init__(self, head_dim: int, theta: float) -> None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        self.inv_freq = 1.0 / (theta**exponents)  # [head_dim/2]

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [b, t] (int) -> cos, sin [b, 1, t, head_dim] ready to broadcast over heads."""
        inv = self.inv_freq.to(positions.device)
        freqs = positions.float()[..., None] * inv  # [b, t, head_dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [b, 1, t, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [b, heads, t, d] rotated by the per-position angles in cos/sin [b, 1, t, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Qwen3 GQA attention weights; the caller decides which keys/values to attend to."""

    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        self.num_heads = shape.num_attention_heads
        self.num_kv_heads = shape.num_key_value_heads
        self.head_dim = shape.head_dim
        q_out = shape.num_attention_heads * shape.head_dim
        kv_out = shape.num_key_value_heads * shape.head_dim
        bias = shape.attention_bias
        self.q_proj = nn.Linear(shape.hidden_size, q_out, bias=bias)
        self.k_proj = nn.Linear(shape.hidden_size, kv_out, bias=bias)
        self.v_proj = nn.Linear(shape.hidden_size, kv_out, bias=bias)
        self.o_proj = nn.Linear(q_out, shape.hidden_size, bias=bias)
        self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)
        self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)

    def _heads(self, x: Tensor, n: int) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)  # [b, t, n*d] -> [b, n, t, d]

    def query(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [b, t, hidden] -> q [b, heads, t, d] (normed, rotated)."""
        q = self.q_norm(self._heads(self.q_proj(x), self.num_heads))
        return apply_rotary(q, cos, sin)

    def key_value(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [b, t, hidden] -> k, v [b, kv_heads, t, d] (k normed and rotated, v raw)."""
        k = self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads))
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        return apply_rotary(k, cos, sin), v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """q [b, h, t, d], k/v [b, kv_h, s, d], mask bool [b, 1, t, s] -> [b, t, hidden]."""
        # enable_gqa: query head h reads kv head h // (heads / kv_heads), without copying K/V
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads
        )
        b, _, t, _ = out.shape
        # [b, h, t, d] -> [b, t, h * d]
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return self.o_proj(out)  # type: ignore[no-any-return]


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # type: ignore[no-any-return]


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        self.self_attn = Attention(shape)
        self.mlp = MLP(shape.hidden_size, shape.intermediate_size)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def feed_forward(self, x: Tensor) -> Tensor:
        """Second half of the layer (x already holds the attention residual)."""
        return x + self.mlp(self.post_attention_layernorm(x))  # type: ignore[no-any-return]
