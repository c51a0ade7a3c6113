"""Stage `eval`: mean acceptance length on held-out prompts at temperature 0 (DFlash or
DFlash2: the drafts are the drafter's own `propose`, as the engine drafts).

Greedy speculative decoding commits exactly the target's greedy output, so acceptance can
be measured against that output directly: generate the target's greedy continuation once
with the engine's model and KV cache, keeping that pass's context features (features at
positions < p are what the engine holds after committing p tokens), then replay the drafting
steps: at committed length p the drafter sees features of positions < p and the block
[x_p, MASK, ...]; the accepted length is the run of drafts equal to the reference, plus
one bonus token. Block size b uses the first b slots of the drafter's block.

Above temperature 0 the eval also reports, on the same seeded text, what a drafter that
always drafts the target's own greedy choice would commit per step (`greedy_oracle_steps`):
the recipe trains drafters on the target's greedy output, so this is where its drafters
would stand had they learnt it perfectly, and it shows how much room the temperature leaves
any of them.
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
from engine.speculative import DecodeRow, PrefillRow, RowSampling, SpecState, prefill, spec_step
from engine.train.corpus import CorpusConfig, heldout_prompts
from engine.train.distill import generate_with_features
from engine.train.tokenizer_recipe import load_tokenizer


@dataclass(frozen=True)
class EvalConfig:
    num_prompts: int = 32
    max_new_tokens: int = 128
    block_sizes: tuple[int, ...] = (4, 8, 16)
    # Also measured through the engine's speculative step with seeded sampling (empty: not).
    temperatures: tuple[float, ...] = ()


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
        # what the engine drafts: DFlash's argmax, DFlash2's selector walk
        drafts = drafter.propose(block_ids[:, 0], hidden)[0].tolist()
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
    return _mean(steps), len(steps)


@dataclass(frozen=True)
class SampledAcceptance:
    """Tokens committed per verify step at one temperature and block size: the drafter's,
    and a drafter's that always drafts the target's greedy choice, on the same text."""

    mean: float
    steps: int
    greedy_oracle: float
    greedy_oracle_steps: int


@torch.no_grad()
def sampled_acceptance(
    target: Qwen3Target,
    drafter: DFlashDrafter,
    prompts: list[list[int]],
    block: int,
    temperature: float,
    max_new_tokens: int,
) -> SampledAcceptance:
    """Decode each prompt with the engine's speculative step (engine/speculative.py) at
    `temperature`, seeded per prompt (seed = prompt index): above 0 acceptance is a draw, so
    it cannot be replayed against one reference. A seeded row's text is the target's keyed
    samples whatever is drafted, so the greedy oracle is replayed on the very text decoded
    (the same for every drafter)."""
    device = target.model.embed_tokens.weight.device
    capacity = max(len(p) for p in prompts) + max_new_tokens + block + 1
    steps: list[int] = []
    oracle: list[int] = []
    for seed, prompt in enumerate(prompts):
        state = SpecState.create(target, drafter, 1, capacity, block, device, torch.float32)
        sampling = RowSampling(temperature=temperature, seed=seed)
        out = prefill(state, [PrefillRow(0, prompt)], [sampling])[0].token_ids
        while len(out) < max_new_tokens:
            row = DecodeRow(slot=0, last_token=out[-1], position=len(prompt) + len(out) - 1)
            result = spec_step(state, [row], [sampling])[0]
            out.extend(result.token_ids)
            steps.append(len(result.token_ids))
        # Its first max_new_tokens only: a step may commit past them, by as many as the
        # drafter's last step accepted, and the oracle must not depend on the drafter.
        text = out[:max_new_tokens]
        oracle.extend(greedy_oracle_steps(greedy_choices(target, prompt, text), text, block))
    return SampledAcceptance(_mean(steps), len(steps), _mean(oracle), len(oracle))


def greedy_choices(target: Qwen3Target, prompt: list[int], output: list[int]) -> list[int]:
    """The target's greedy choice for each output token after the first (one forward over
    the whole text): what it would have committed at temperature 0 from that prefix."""
    device = target.model.embed_tokens.weight.device
    text = torch.tensor([prompt + output[:-1]], device=device)
    logits = target(text, torch.arange(text.shape[1], device=device)[None]).logits
    return [int(t) for t in logits[0, len(prompt) :].argmax(-1).tolist()]


def greedy_oracle_steps(greedy: list[int], output: list[int], block: int) -> list[int]:
    """Tokens committed per verify step decoding `output` (its first token from the
    prefill) with drafts that are the target's greedy choices `greedy` [i predicts output[i
    + 1]], `block - 1` a step: a draft stands while the text's token equals it, and the
    step adds the text's next token as its bonus, as a seeded step does, until the text is
    out."""
    steps, done = [], 1
    while done < len(output):
        accepted = 0
        while (
            accepted < block - 1
            and done + accepted + 1 < len(output)
            and output[done + accepted] == greedy[done + accepted - 1]
        ):
            accepted += 1
        steps.append(accepted + 1)
        done += accepted + 1
    return steps


def _mean(values: list[int]) -> float:
    return sum(values) / len(values) if values else float("nan")


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
    sampled: list[dict[str, float | int]] = []
    for temperature in cfg.temperatures:
        for block in cfg.block_sizes:
            found = sampled_acceptance(
                target, drafter, prompts, block, temperature, cfg.max_new_tokens
            )
            sampled.append(
                {
                    "temperature": temperature,
                    "block_size": block,
                    "mean_acceptance_length": found.mean,
                    "verify_steps": found.steps,
                    "greedy_oracle_acceptance_length": found.greedy_oracle,
                    "greedy_oracle_verify_steps": found.greedy_oracle_steps,
                }
            )
    result: dict[str, object] = {
        "num_prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": 0.0,
        "results": rows,
    }
    if sampled:
        result["sampled_results"] = sampled
    header = f"{'T':>4} {'block':>6} {'mean acceptance length':>24} {'steps':>7}"
    print(header + (f" {'greedy oracle':>14}" if sampled else ""))
    for row in [{"temperature": 0.0, **r} for r in rows] + sampled:
        tau, n_steps = row["mean_acceptance_length"], row["verify_steps"]
        oracle = row.get("greedy_oracle_acceptance_length")
        column = "" if oracle is None else f" {oracle:>14.3f}"
        print(f"{row['temperature']:>4} {row['block_size']:>6} {tau:>24.3f} {n_steps:>7}{column}")
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(result, indent=2) + "\n")
    return result
