"""Stage `distill`: the target's own greedy continuations on corpus prompts.

DFlash trains the drafter on what the target actually generates (self-distillation), not on
the corpus: acceptance is about predicting the target. Prompts are fixed-length token
windows of the training stream (so batches need no padding); a fraction are wrapped as
ChatML user turns, so the drafter also sees the chat endpoint's distribution. Generation
runs in chunks saved to disk, so an interrupted run resumes at the next chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from engine.loader import load_target
from engine.model import Qwen3Target
from engine.train.corpus import CorpusConfig, read_documents, training_files
from engine.train.data import ChatIds, cached_stream
from engine.train.tokenizer_recipe import ENDOFTEXT, IM_END, load_tokenizer, token_id


@dataclass(frozen=True)
class DistillConfig:
    num_sequences: int = 2048
    prompt_len: int = 128
    gen_len: int = 128
    chunk: int = 64  # sequences generated together (one batch, one saved chunk)
    chat_fraction: float = 0.2
    seed: int = 1

    @classmethod
    def smoke(cls) -> DistillConfig:
        return cls(num_sequences=4, prompt_len=16, gen_len=8, chunk=2)


@dataclass
class DistillData:
    tokens: torch.Tensor  # [n, prompt_len + gen_len] int64
    lengths: torch.Tensor  # [n] valid tokens per row (generation cut after the first stop)
    prompt_len: int
    features: torch.Tensor  # [n, L, len(layer_ids) * hidden] fp16 target context features


def _prompts(stream: torch.Tensor, chat: ChatIds, cfg: DistillConfig, chunk: int) -> torch.Tensor:
    """`cfg.chunk` prompts of exactly `cfg.prompt_len` tokens, deterministic per chunk."""
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + chunk)
    wrap = len(chat.user_open) + len(chat.turn_close)
    starts = torch.randint(0, stream.numel() - cfg.prompt_len, (cfg.chunk,), generator=gen)
    is_chat = torch.rand(cfg.chunk, generator=gen) < cfg.chat_fraction
    rows = []
    for start, as_chat in zip(starts.tolist(), is_chat.tolist(), strict=True):
        if as_chat:
            body = stream[start : start + cfg.prompt_len - wrap].tolist()
            rows.append(chat.user_open + body + chat.turn_close)
        else:
            rows.append(stream[start : start + cfg.prompt_len].tolist())
    return torch.tensor(rows, dtype=torch.long)  # [chunk, prompt_len]


def _valid_lengths(tokens: torch.Tensor, prompt_len: int, stop_ids: list[int]) -> torch.Tensor:
    """Per row: tokens up to and including the first generated stop token (or all)."""
    gen = tokens[:, prompt_len:]
    is_stop = torch.isin(gen, torch.tensor(stop_ids))
    first = torch.where(is_stop.any(1), is_stop.float().argmax(1) + 1, gen.shape[1])
    return prompt_len + first


@torch.no_grad()
def generate_with_features(
    target: Qwen3Target, prompts: torch.Tensor, gen_len: int, layer_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy continuation of equal-length `prompts` [b, P] with the engine's target and KV
    cache (never stops early; cut afterwards). Returns tokens [b, P + gen_len] and the
    context features [b, P + gen_len, n * hidden] (hidden states at `layer_ids`) that the
    same pass produced; the last position, never fed to the target, gets zeros."""
    b, prompt_len = prompts.shape
    device = prompts.device
    cache = target.new_cache(b, prompt_len + gen_len, device, torch.float32)
    slots = torch.arange(b, device=device)
    positions = torch.arange(prompt_len, device=device).expand(b, prompt_len)
    last = torch.full((b, 1), prompt_len - 1, device=device)
    out = target(prompts, positions, None, cache, slots, layer_ids, logit_index=last)
    tokens, feats = [prompts], []
    for step in range(gen_len):
        assert out.hidden is not None
        feats.append(out.hidden.half())
        next_ids = out.logits[:, -1].argmax(-1, keepdim=True)  # [b, 1]
        tokens.append(next_ids)
        if step + 1 < gen_len:
            pos = torch.full((b, 1), prompt_len + step, device=device)
            out = target(next_ids, pos, None, cache, slots, layer_ids)
    feats.append(torch.zeros_like(feats[-1][:, :1]))
    return torch.cat(tokens, dim=1), torch.cat(feats, dim=1)


def run_distill(
    corpus: CorpusConfig, target_dir: Path, run_dir: Path, cfg: DistillConfig, layer_ids: list[int]
) -> None:
    tok = load_tokenizer(target_dir)
    stream = cached_stream(tok, read_documents(training_files(corpus)), run_dir / "stream.pt")
    chat = ChatIds.from_tokenizer(tok)
    # The saved (bf16) weights run in float32 by the engine's own model: the sequences and
    # features are exactly what the engine computes when serving.
    target = load_target(target_dir)
    chunks = -(-cfg.num_sequences // cfg.chunk)
    run_dir.mkdir(parents=True, exist_ok=True)
    for i in tqdm(range(chunks), desc="distill"):
        path = run_dir / f"chunk_{i:04d}.pt"
        if not path.exists():
            prompts = _prompts(stream, chat, cfg, i)
            tokens, features = generate_with_features(target, prompts, cfg.gen_len, layer_ids)
            chunk = {"tokens": tokens.to(torch.int32), "features": features, "layer_ids": layer_ids}
            torch.save(chunk, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").replace(path)
    stops = [token_id(tok, IM_END), token_id(tok, ENDOFTEXT)]
    data = load_distill(run_dir, cfg.prompt_len, stops, layer_ids)
    gen_tokens = int((data.lengths - data.prompt_len).sum())
    print(f"distill: {data.tokens.shape[0]} sequences, {gen_tokens} generated tokens -> {run_dir}")


def load_distill(
    run_dir: Path, prompt_len: int, stop_ids: list[int], layer_ids: list[int]
) -> DistillData:
    paths = sorted(run_dir.glob("chunk_*.pt"))
    if not paths:
        raise FileNotFoundError(f"no distillation data in {run_dir}: run `dflash-train distill`")
    chunks = [torch.load(p) for p in paths]
    if any(c["layer_ids"] != layer_ids for c in chunks):
        raise ValueError(f"{run_dir}: features were made for other target_layer_ids; re-distill")
    tokens = torch.cat([c["tokens"] for c in chunks]).long()
    features = torch.cat([c["features"] for c in chunks])
    lengths = _valid_lengths(tokens, prompt_len, stop_ids)
    return DistillData(tokens, lengths, prompt_len, features)
