"""Stage `eval`: mean acceptance length on held-out prompts at temperature 0.

Greedy speculative decoding commits exactly the target's greedy output, so acceptance can
be measured against that output directly: generate the target's greedy continuation once
with the engine's model and KV cache, keeping that pass's context features (features at
positions < p are what the engine holds after committing p tokens), then replay the drafting
steps: at committed length p the drafter sees features of positions < p and the block
[x_p, MASK, ...]; the accepted length is the run of drafts equal to the reference, plus
one bonus token. Block size b uses the first b slots of the drafter's block.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from engine.drafter import DFlashDrafter
from engine.loader import load_drafter, load_target
from engine.model import Qwen3Target
from engine.train.corpus import CorpusConfig, heldout_prompts
from engine.train.distill import generate_with_features
from engine.train.tokenizer_recipe import load_tokenizer


@dataclass(frozen=True)
class EvalConfig:
    num_prompts: int = 32
    max_new_tokens: int = 128
    block_sizes: tuple[int, ...] = (4, 8, 16)


@torch.no_grad()
def acceptance_lengths(
    drafter: DFlashDrafter, seq: list[int], features: torch.Tensor, prompt_len: int, block: int
) -> list[int]:
    """Tokens committed per verify step (accepted drafts + 1 bonus) replaying `seq` [L],
    the target's greedy output, given its context features [1, L, n * hidden]."""
    device = features.device
    steps, p = [], prompt_len  # x_p = first generated token, committed but not processed
    while p < len(seq) - 1:
        block_ids = torch.full((1, block), drafter.mask_token_id, device=device)
        block_ids[0, 0] = seq[p]
        positions = torch.arange(p, p + block, device=device)[None]
        context = torch.arange(p, device=device)[None]
        hidden = drafter(block_ids, positions, features[:, :p].float(), context)
        drafts = drafter.logits(hidden)[0, 1:].argmax(-1).tolist()
        accepted = 0
        for k, token in enumerate(drafts, start=1):
            if p + k >= len(seq) or token != seq[p + k]:
                break
            accepted += 1
        steps.append(accepted + 1)
        p += accepted + 1
    return steps


Reference = tuple[list[int], torch.Tensor]  # the target's greedy sequence, its features


def greedy_references(
    target: Qwen3Target, prompts: list[list[int]], max_new_tokens: list[int], layer_ids: list[int]
) -> list[Reference]:
    """Per prompt: the target's greedy continuation of `max_new_tokens[i]` tokens and that
    pass's context features (on the target's device), for `mean_acceptance`."""
    device = target.model.embed_tokens.weight.device
    refs = []
    for prompt, n in zip(tqdm(prompts, desc="reference"), max_new_tokens, strict=True):
        ids = torch.tensor([prompt], device=device)
        seq, feats = generate_with_features(target, ids, n, layer_ids)
        refs.append((seq[0].tolist(), feats))
    return refs


def mean_acceptance(
    drafter: DFlashDrafter, prompts: list[list[int]], refs: list[Reference], block: int
) -> tuple[float, int]:
    """Mean acceptance length at temperature 0 over every verify step of every reference,
    and the number of steps."""
    steps = [
        s
        for prompt, (seq, feats) in zip(prompts, refs, strict=True)
        for s in acceptance_lengths(drafter, seq, feats, len(prompt), block)
    ]
    return (sum(steps) / len(steps) if steps else float("nan")), len(steps)


def run_eval(
    corpus: CorpusConfig, out_dir: Path, drafter_dir: str, report: Path, cfg: EvalConfig
) -> dict[str, object]:
    tok = load_tokenizer(out_dir / "target")
    target = load_target(out_dir / "target")
    drafter = load_drafter(out_dir / drafter_dir, target)
    prompts = [tok.encode(p).ids for p in heldout_prompts(cfg.num_prompts, config=corpus)]
    ids = list(drafter.config.target_layer_ids)
    refs = greedy_references(target, prompts, [cfg.max_new_tokens] * len(prompts), ids)
    rows: list[dict[str, float | int]] = []
    for block in cfg.block_sizes:
        mean, count = mean_acceptance(drafter, prompts, refs, block)
        rows.append({"block_size": block, "mean_acceptance_length": mean, "verify_steps": count})
    result = {
        "num_prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": 0.0,
        "results": rows,
    }
    print(f"{'block':>6} {'mean acceptance length':>24} {'steps':>7}")
    for row in rows:
        tau, n_steps = row["mean_acceptance_length"], row["verify_steps"]
        print(f"{row['block_size']:>6} {tau:>24.3f} {n_steps:>7}")
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(result, indent=2) + "\n")
    return result
