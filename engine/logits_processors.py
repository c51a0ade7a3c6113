"""A request's logits processors, applied to the target's logits position by position.

In a verify step the logits at block position k predict the token after the committed
output plus drafts[:k], so every processor that reads the history (penalties, min_tokens,
bad words) sees exactly that history at position k. A draft that is accepted therefore met
the same processed distribution that plain decoding would have used at that position, and
the output is plain decoding's, token for token.

vLLM's order (v1 Sampler): allowed_token_ids, bad_words, min_tokens, logit_bias, then the
repetition / frequency / presence penalties; temperature, min_p, top-k and top-p follow in
sampling.probabilities.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class LogitsProcessing:
    """What one request asks of its logits, resolved to token ids."""

    repetition_penalty: float = 1.0  # over prompt and output tokens (1 = off)
    frequency_penalty: float = 0.0  # times the output count of each token
    presence_penalty: float = 0.0  # once for every token already in the output
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()  # masked while the output is shorter than min_tokens
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences never to complete
    allowed_token_ids: tuple[int, ...] | None = None  # None: every token

    @property
    def active(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or bool(self.logit_bias)
            or (self.min_tokens > 0 and bool(self.stop_token_ids))
            or bool(self.bad_words)
            or self.allowed_token_ids is not None
        )


NEG_INF = float("-inf")


def process_block(
    logits: Tensor,
    proc: LogitsProcessing,
    prompt: Sequence[int],
    output: Sequence[int],
    drafts: Sequence[int],
) -> Tensor:
    """logits [B, vocab] for one row's block -> processed float32 logits [B, vocab].

    Position k's history is `output` + drafts[:k] (B == len(drafts) + 1); the prompt only
    feeds the repetition penalty."""
    width, vocab = logits.shape
    if width != len(drafts) + 1:
        raise ValueError(f"{width} block positions for {len(drafts)} drafts")
    out = logits.float().clone()
    dev = out.device
    if proc.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool, device=dev)
        keep[list(proc.allowed_token_ids)] = True
        out.masked_fill_(~keep, NEG_INF)
    for k in range(width):
        banned = _banned_words(proc.bad_words, output, drafts[:k])
        if len(output) + k < proc.min_tokens:
            banned.extend(proc.stop_token_ids)
        if banned:
            out[k, banned] = NEG_INF
    if proc.logit_bias:
        ids = torch.tensor([t for t, _ in proc.logit_bias], device=dev)
        bias = torch.tensor([b for _, b in proc.logit_bias], device=dev)
        out.index_add_(1, ids, bias.expand(width, -1))
    if proc.repetition_penalty != 1.0 or proc.frequency_penalty or proc.presence_penalty:
        _penalise(out, proc, prompt, output, drafts)
    _never_empty(out, logits, proc)
    return out


def _never_empty(out: Tensor, raw: Tensor, proc: LogitsProcessing) -> None:
    """A position where the masks left no token at all (e.g. a multi-token bad word that
    the only allowed tokens keep completing): let the stop tokens through, so the output
    ends there, or, with none, the raw logits. Without this the row's distribution would be
    NaN, and one request could fail the step of every request batched with it. Masks that
    can never be met are refused before this (Engine.add_request)."""
    empty = torch.isneginf(out).all(dim=-1)
    if not bool(empty.any()):
        return
    for k in empty.nonzero().flatten().tolist():
        if proc.stop_token_ids:
            ids = list(proc.stop_token_ids)
            out[k, ids] = raw[k, ids].float()
        else:
            out[k] = raw[k].float()


def _banned_words(
    bad_words: tuple[tuple[int, ...], ...], output: Sequence[int], extra: Sequence[int]
) -> list[int]:
    """The last token of every bad word whose other tokens end the history."""
    banned = []
    for word in bad_words:
        head = len(word) - 1
        if head == 0 or _ends_with(output, extra, word[:-1]):
            banned.append(word[-1])
    return banned


def _ends_with(output: Sequence[int], extra: Sequence[int], tail: Sequence[int]) -> bool:
    """Does output + extra end with tail (without concatenating the whole output)?"""
    n = len(tail)
    if n > len(output) + len(extra):
        return False
    from_extra = min(n, len(extra))
    if list(extra[len(extra) - from_extra :]) != list(tail[n - from_extra :]):
        return False
    rest = n - from_extra
    return rest == 0 or list(output[len(output) - rest :]) == list(tail[:rest])


def _penalise(
    out: Tensor,
    proc: LogitsProcessing,
    prompt: Sequence[int],
    output: Sequence[int],
    drafts: Sequence[int],
) -> None:
    """vLLM's penalties in place: repetition (divide positive logits, multiply negative ones,
    for tokens seen in the prompt or output), then frequency and presence (output only)."""
    width, vocab = out.shape
    dev = out.device
    counts = torch.zeros(width, vocab, device=dev)
    if output:
        counts += torch.bincount(torch.tensor(list(output), device=dev), minlength=vocab)
    if drafts:  # position k also counts drafts[:k]
        steps = torch.nn.functional.one_hot(torch.tensor(list(drafts), device=dev), vocab)
        counts[1:] += steps.cumsum(dim=0).float()
    seen = counts > 0
    if proc.repetition_penalty != 1.0:
        in_prompt = torch.zeros(vocab, dtype=torch.bool, device=dev)
        if prompt:
            in_prompt[list(prompt)] = True
        hit = seen | in_prompt
        penalty = proc.repetition_penalty
        scaled = torch.where(out > 0, out / penalty, out * penalty)
        out.copy_(torch.where(hit, scaled, out))
    if proc.frequency_penalty:
        out -= proc.frequency_penalty * counts
    if proc.presence_penalty:
        out -= proc.presence_penalty * seen.float()
