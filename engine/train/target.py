"""Stage `target`: train the tiny-coder Qwen3 target with transformers' Qwen3ForCausalLM.

Sizing (2 shared CPU cores, ~25 min): hidden 256, 6 layers, 4 query / 2 KV heads of 64,
SwiGLU 768, tied embeddings, vocab 4096: 5.8 M parameters. Alone on 2 cores this trains at
~2-3 k tokens/s; on a busy shared machine one thread (no spinning) gets ~1-2 k tokens/s,
so 480 steps x 16 x 256 tokens (~2 M tokens, about one pass over the corpus) fit the budget.
Six layers against a two-layer drafter keep the draft cheap relative to a target forward,
which is what makes speculation pay off on CPU too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import Qwen3Config, Qwen3ForCausalLM

from engine.train.corpus import CorpusConfig, heldout_files, read_documents, training_files
from engine.train.data import ChatIds, cached_stream, encode_stream, sample_batch
from engine.train.loop import LoopConfig, train_loop
from engine.train.tokenizer_recipe import ENDOFTEXT, IM_END, PAD, load_tokenizer, token_id


@dataclass(frozen=True)
class TargetRecipe:
    """The recipe's target: its architecture and how long to train it (engine.model's
    TargetConfig is the architecture as a loaded checkpoint states it)."""

    hidden_size: int = 256
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    seq_len: int = 256
    batch_size: int = 16
    chat_fraction: float = 0.2
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(steps=480, lr=3e-3, warmup=40))

    @classmethod
    def smoke(cls, steps: int = 3) -> TargetRecipe:
        return cls(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            intermediate_size=128,
            seq_len=64,
            batch_size=2,
            loop=LoopConfig(steps=steps, lr=1e-3, warmup=1, ckpt_every=2),
        )


def qwen3_config(cfg: TargetRecipe, tok: Tokenizer) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=tok.get_vocab_size(),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=token_id(tok, ENDOFTEXT),
        eos_token_id=token_id(tok, IM_END),
        pad_token_id=token_id(tok, PAD),
    )


def _lm_loss(model: Qwen3ForCausalLM, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits  # [b, t, vocab]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


@torch.no_grad()
def heldout_loss(model: Qwen3ForCausalLM, stream: torch.Tensor, seq_len: int, n: int = 16) -> float:
    """Mean next-token loss over `n` evenly spaced windows of the held-out stream."""
    model.train(False)
    stride = max(1, (stream.numel() - seq_len - 1) // n)
    rows = [stream[i * stride : i * stride + seq_len + 1].long() for i in range(n)]
    return float(_lm_loss(model, torch.stack(rows)))


SERVING_DTYPE = "float32"  # see save_target


def save_target(model: Qwen3ForCausalLM, out_dir: Path, tok: Tokenizer) -> None:
    """HF layout, weights stored as bf16 (half the bytes). config.json names float32, the
    dtype the model was trained and is served in: `--dtype auto` means the config's dtype to
    vLLM and to the embedded engine alike, and the lossless oracle is exact in float32."""
    torch.nn.Module.to(model, torch.bfloat16)  # (transformers' typed .to() rejects dtypes)
    model.save_pretrained(out_dir)
    torch.nn.Module.to(model, torch.float32)
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = SERVING_DTYPE
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    eos = [token_id(tok, IM_END), token_id(tok, ENDOFTEXT)]
    gen = {"eos_token_id": eos, "pad_token_id": token_id(tok, PAD), "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def train_target(corpus: CorpusConfig, target_dir: Path, run_dir: Path, cfg: TargetRecipe) -> None:
    """Train on the corpus and write config + bf16 safetensors next to the tokenizer."""
    tok = load_tokenizer(target_dir)
    stream = cached_stream(tok, read_documents(training_files(corpus)), run_dir / "stream.pt")
    chat = ChatIds.from_tokenizer(tok)
    torch.manual_seed(cfg.loop.seed)
    model = Qwen3ForCausalLM(qwen3_config(cfg, tok))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"target: {n_params / 1e6:.2f} M params, {stream.numel()} training tokens")

    def step_fn(step: int, gen: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        batch = sample_batch(stream, cfg.batch_size, cfg.seq_len, chat, cfg.chat_fraction, gen)
        loss = _lm_loss(model, batch)
        return loss, {"loss": float(loss.detach())}

    train_loop(model, step_fn, cfg.loop, run_dir, "target")
    held = encode_stream(tok, read_documents(heldout_files(corpus)))
    save_target(model, target_dir, tok)
    print(f"target: held-out loss {heldout_loss(model, held, cfg.seq_len):.3f} -> {target_dir}")
