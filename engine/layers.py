"""Qwen3 building blocks shared by the target model and the DFlash drafter.

Module and parameter names follow the Hugging Face Qwen3 layout (q_proj, k_norm,
gate_proj, input_layernorm, ...) so that checkpoints load by key name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

# On CUDA, attention without cuDNN's kernel. PyTorch picks cuDNN for one-token queries, and
# cuDNN builds an execution plan for every new key length (cached per shape, ~50 ms each on
# an H100 with torch 2.11): decoding grows the keys by one every step, so every plain step
# paid it (55-71 ms a step against 5-6 ms with any other backend; drafting steps, whose
# queries cuDNN does not take, never did). Flash and memory-efficient where they apply, else
# the math kernel (GQA with a mask).
CUDA_ATTENTION_BACKENDS = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


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
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """weight * x / rms(x) over the last dim, in fp32. For fp32 input the fused op gives the
    same bits as the textbook formula (checked in tests) with one dispatch instead of seven."""
    if x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    normed = x32.to(x.dtype)
    return normed if weight is None else weight * normed


class Rotary:
    """RoPE tables (non-interleaved "neox" halves, as HF Qwen3) for arbitrary positions.

    `cos_sin` returns sin with the first half negated ("signed sin"), so that
    `apply_rotary` is x * cos + roll(x, d/2) * sin: (-x2) * s == x2 * (-s) exactly, so this
    is bit-identical to the textbook x * cos + cat(-x2, x1) * sin with fewer ops. Tables
    are cached per (device, dtype) and grown on demand: one gather per forward."""

    def __init__(self, head_dim: int, theta: float) -> None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        self.inv_freq = 1.0 / (theta**exponents)  # [head_dim/2]
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor]] = {}

    def _table(self, n: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        cached = self._tables.get((device, dtype))
        if cached is not None and cached[0].shape[0] >= n:
            return cached
        size = max(n, 2 * (cached[0].shape[0] if cached is not None else 1024))
        with torch.inference_mode(False), torch.no_grad():
            freqs = torch.arange(size, dtype=torch.float32)[:, None] * self.inv_freq  # [n, d/2]
            emb = torch.cat([freqs, freqs], dim=-1)  # [n, d]
            half = freqs.shape[-1]
            sign = torch.cat([-torch.ones(half), torch.ones(half)])
            table = (emb.cos().to(device, dtype), (emb.sin() * sign).to(device, dtype))
        self._tables[(device, dtype)] = table
        return table

    def cos_sin(
        self, positions: Tensor, dtype: torch.dtype, max_position: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """positions [b, t] (int) -> cos, signed sin [b, 1, t, head_dim], ready to broadcast
        over heads. `max_position` (a host int) spares a device->host read of the maximum."""
        top = int(positions.max()) if max_position is None else max_position
        cos, sin = self._table(top + 1, positions.device, dtype)
        flat = positions.reshape(-1)
        shape = (*positions.shape[:1], 1, *positions.shape[1:], cos.shape[-1])
        return cos.index_select(0, flat).view(shape), sin.index_select(0, flat).view(shape)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [b, heads, t, d] rotated by the per-position angles in cos / signed sin [b, 1, t, d]."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def _onednn_linear_available() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    available = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    return bool(
        available
        and ops is not None
        and hasattr(ops, "_linear_pointwise")
        and hasattr(ops, "_reorder_linear_weight")
    )


ONEDNN_LINEAR = _onednn_linear_available()


def _int8_linear_available() -> bool:
    ops = getattr(torch.ops, "quantized", None)
    return bool(
        ops is not None
        and hasattr(ops, "linear_dynamic")
        and hasattr(ops, "linear_prepack")
        and "fbgemm" in torch.backends.quantized.supported_engines
    )


INT8_LINEAR = _int8_linear_available()


def _pack_int8(weight: Tensor) -> object:
    """fbgemm's packed form of a float weight [out, in], quantized per output row
    (symmetric, scale = max |w| / 127)."""
    import warnings

    scale = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
    zero = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # the quantized-tensor constructors warn of a future API
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(weight.float(), scale, zero, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(q, None)


def _source_key(parts: list[Tensor]) -> tuple[object, ...]:
    """What identifies the weights a copy was made from: in-place edits bump `_version`,
    `.to()` changes `data_ptr`."""
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in parts)


def _concatenated(parts: list[Tensor], dtype: torch.dtype | None) -> Tensor:
    """The parts stacked along the output dim (cast to `dtype` when given), outside
    autograd and inference mode: a plain tensor the caches may keep."""
    with torch.inference_mode(False), torch.no_grad():
        weight = torch.cat([p.detach() for p in parts], dim=0)
        return weight.to(dtype or weight.dtype).contiguous()


class FusedWeight:
    """Inference copy of one or more Linear weights, concatenated along the output dim,
    rebuilt when any source changes (in-place edits bump `_version`, `.to()` changes
    `data_ptr`). One wide matmul instead of several narrow ones.

    `linear` runs float32 CPU matmuls through oneDNN with the weight prepacked once:
    on the CPUs measured (AMD EPYC, AVX-512) it is 2-2.6x faster than the default BLAS
    for 4-128 rows, and each row's result does not depend on how many rows are in the
    batch (the default BLAS path gives different bits for 1 row and for 16), so a
    verify over a block computes exactly what plain decoding computes token by token.

    `int8`: matmuls with the weight quantized per row to int8 and the input per call
    (fbgemm's dynamic linear, ~1.8x faster than oneDNN float32 at 16 rows here). Only
    for a drafter: its outputs are proposals the target verifies, so they may round
    differently; the target's own weights are never quantized."""

    def __init__(self, int8: bool = False) -> None:
        self.int8 = int8
        self._int8_packed: tuple[tuple[object, ...], object] | None = None
        # per compute dtype (a bfloat16 drafter borrowing a float32 lm_head): source
        # version key, the concatenated weight, its oneDNN-packed form (made on first use)
        self._copies: dict[
            torch.dtype | None, tuple[tuple[object, ...], Tensor, Tensor | None]
        ] = {}

    def get(self, parts: list[Tensor], dtype: torch.dtype | None = None) -> Tensor:
        """The parts concatenated along dim 0 (and cast to `dtype` when given)."""
        return self._entry(parts, dtype)[1]

    def _entry(
        self, parts: list[Tensor], dtype: torch.dtype | None
    ) -> tuple[tuple[object, ...], Tensor, Tensor | None]:
        key = _source_key(parts)
        entry = self._copies.get(dtype)
        if entry is None or entry[0] != key:
            entry = self._copies[dtype] = (key, _concatenated(parts, dtype), None)
        return entry

    def linear(self, x: Tensor, parts: list[Tensor]) -> Tensor:
        """x @ concat(parts).T (inference only: no autograd through the copies)."""
        if self.int8 and INT8_LINEAR and x.dtype == torch.float32 and x.device.type == "cpu":
            return self._linear_int8(x, parts)
        key, weight, packed = self._entry(parts, x.dtype)
        if not (ONEDNN_LINEAR and x.dtype == torch.float32 and x.device.type == "cpu"):
            return F.linear(x, weight)
        if packed is None:
            with torch.inference_mode(False), torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(weight)
            self._copies[x.dtype] = (key, weight, packed)
        out: Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return out

    def _linear_int8(self, x: Tensor, parts: list[Tensor]) -> Tensor:
        key = _source_key(parts)
        if self._int8_packed is None or self._int8_packed[0] != key:
            self._int8_packed = (key, _pack_int8(_concatenated(parts, None)))
        # reduce_range: 7-bit activations, so fbgemm's int16 accumulation cannot saturate
        out: Tensor = torch.ops.quantized.linear_dynamic(x, self._int8_packed[1], True)
        return out


def linear(module: nn.Linear, x: Tensor) -> Tensor:
    """module(x); without autograd through the module's own FusedWeight (see there),
    kept on the module, so a Linear shared by two models (the lm_head a drafter borrows
    from its target) has one prepacked copy."""
    if torch.is_grad_enabled() or module.bias is not None:
        return module(x.to(module.weight.dtype))  # type: ignore[no-any-return]
    cache = module.__dict__.get("_inference_weight")
    if not isinstance(cache, FusedWeight):
        cache = FusedWeight()
        module.__dict__["_inference_weight"] = cache
    return cache.linear(x, [module.weight])


def use_int8_matmuls(module: nn.Module) -> None:
    """Every inference matmul of `module`'s own Linear layers (fused or not) in int8 from
    now on (FusedWeight `int8`): drafters only. A no-op where fbgemm is unavailable."""
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            sub.__dict__["_inference_weight"] = FusedWeight(int8=True)
        for value in vars(sub).values():
            if isinstance(value, FusedWeight):
                value.int8 = True


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

        self._qkv = FusedWeight()
        self._kv = FusedWeight()
        self._qk_norm = FusedWeight()

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

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Inference: q, k, v from ONE matmul; q and k normed and rotated together.
        Same values as `query` + `key_value`. Training (grad enabled) takes those."""
        if torch.is_grad_enabled() or self.q_proj.bias is not None:
            return (self.query(x, cos, sin), *self.key_value(x, cos, sin))
        b, t, _ = x.shape
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self._qkv.linear(x, [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        qkv = qkv.view(b, t, h + 2 * kvh, d)
        qk = self._norm_qk(qkv[:, :, : h + kvh])  # [b, t, h + kvh, d]
        qk = apply_rotary(qk.transpose(1, 2), cos, sin)  # [b, h + kvh, t, d]
        return qk[:, :h], qk[:, h:], qkv[:, :, h + kvh :].transpose(1, 2)

    def project_kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Inference: k, v from ONE matmul (same values as `key_value`)."""
        if torch.is_grad_enabled() or self.k_proj.bias is not None:
            return self.key_value(x, cos, sin)
        b, t, _ = x.shape
        kvh, d = self.num_kv_heads, self.head_dim
        kv = self._kv.linear(x, [self.k_proj.weight, self.v_proj.weight])
        kv = kv.view(b, t, 2 * kvh, d)
        k = rms_norm(kv[:, :, :kvh], self.k_norm.weight, self.k_norm.eps)
        return apply_rotary(k.transpose(1, 2), cos, sin), kv[:, :, kvh:].transpose(1, 2)

    def _norm_qk(self, qk: Tensor) -> Tensor:
        """q_norm on the query heads and k_norm on the key heads in one op: the norm
        without weight, times the per-head weights stacked [h + kvh, d] (same products)."""
        h, kvh = self.num_heads, self.num_kv_heads
        weight = self._qk_norm.get(
            [self.q_norm.weight[None].expand(h, -1), self.k_norm.weight[None].expand(kvh, -1)]
        )
        return rms_norm(qk, None, self.q_norm.eps) * weight

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """q [b, h, t, d], k/v [b, kv_h, s, d], mask bool [b, 1, t, s] -> [b, t, hidden]."""
        # enable_gqa: query head h reads kv head h // (heads / kv_heads), without copying K/V
        gqa = self.num_kv_heads != self.num_heads
        if q.is_cuda:
            with sdpa_kernel(CUDA_ATTENTION_BACKENDS):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        b, _, t, _ = out.shape
        # [b, h, t, d] -> [b, t, h * d]
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return linear(self.o_proj, out)


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self._gate_up = FusedWeight()

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled():
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # type: ignore[no-any-return]
        # inference: gate and up from one matmul
        both = self._gate_up.linear(x, [self.gate_proj.weight, self.up_proj.weight])
        gate, up = both.chunk(2, dim=-1)
        return linear(self.down_proj, F.silu(gate) * up)


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
