"""The tensor work of one engine step: prefill, one batched speculative step, release.

A step over rows (one running request each, in its own cache slot):
1. ONE drafter forward over every row's block [last, MASK, ...] gives block_size - 1
   deterministic (argmax) draft tokens per row.
2. ONE target forward verifies every block on top of the rows' target caches.
3. Per row: the row's logits processors (penalties, logit bias, bad words, ...) run
   position by position, each position seeing the history it extends
   (logits_processors.py); greedy rows accept the longest prefix matching the processed
   argmax; sampled rows accept draft x with probability p(x) and otherwise sample from p
   with x removed (renormalised). Either way one bonus token from the target follows.
   Since the drafts are deterministic this keeps the output distribution exactly the
   target's. Rows that asked for log-probabilities get the target's at each committed
   token (logprobs.py).
4. Commit: the target hidden states of the committed block positions become drafter
   context (K/V in its cache); rollback: both caches' slot lengths are set back.
block_size 1 (or no drafter) runs the same code as plain decoding.

Invariant between steps: for a running slot, target length == drafter context length ==
position of `last_token`, which is committed but not yet in any cache.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from engine.drafter import DFlashDrafter
from engine.kv_cache import CacheIndex, SlotCaches
from engine.logits_processors import process_block
from engine.logprobs import TokenLogprob, token_logprobs
from engine.model import Qwen3Target
from engine.sampling import RowSampling, greedy, row_probabilities, sample, uniform

__all__ = [
    "DecodeRow",
    "PrefillRow",
    "RowResult",
    "RowSampling",
    "SpecState",
    "StepTimings",
    "TokenLogprob",
    "accept_greedy",
    "accept_sampled",
    "max_draft_tokens",
    "prefill",
    "release",
    "row_probabilities",
    "spec_step",
]


@dataclass(frozen=True)
class PrefillRow:
    slot: int
    token_ids: list[int]  # prompt tokens to put into the slot's caches


@dataclass(frozen=True)
class DecodeRow:
    slot: int
    last_token: int  # last committed token; NOT yet in the target cache
    position: int  # its position == number of tokens in the slot's target cache
    # The history, read only by logits processors (references, not copies).
    prompt: Sequence[int] = ()
    output: Sequence[int] = ()  # every committed output token, last_token included


@dataclass(frozen=True)
class RowResult:
    token_ids: list[int]  # committed this step: accepted drafts + 1 bonus (1..block_size)
    num_drafted: int  # drafts proposed for this row (block_size - 1; 0 when plain)
    num_accepted: int  # len(token_ids) - 1
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when asked for
    # prefill only, when asked for: one per prompt token after the first
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class SpecState:
    """What a step needs; built once by the engine with `SpecState.create`."""

    target: Qwen3Target
    drafter: DFlashDrafter | None  # None = plain decoding
    caches: SlotCaches
    block_size: int  # tokens verified per step (1 = plain)
    device: torch.device

    @classmethod
    def create(
        cls,
        target: Qwen3Target,
        drafter: DFlashDrafter | None,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> SpecState:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        active = drafter if block_size > 1 else None
        size = block_size if active is not None else 1
        capacity = max_model_len + size  # a step near the limit never overflows
        target_cache = target.new_cache(max_num_seqs, capacity, device, dtype)
        # the drafter's context cache is in the drafter's own dtype (may differ: see .dtype)
        draft_cache = (
            None
            if active is None
            else active.new_cache(max_num_seqs, capacity, device, active.dtype)
        )
        return cls(
            target=target,
            drafter=active,
            caches=SlotCaches(target_cache, draft_cache),
            block_size=size,
            device=torch.device(device),
        )

    def layer_ids(self) -> list[int]:
        return [] if self.drafter is None else list(self.drafter.config.target_layer_ids)

    def kv_cache_usage(self) -> float:
        return self.caches.usage()


def release(state: SpecState, slot: int) -> None:
    """Empty a slot's caches (length 0); its storage is reused by the next request."""
    state.caches.release(slot)


def _first_token(logits: Tensor, prompt: list[int], sampling: RowSampling) -> RowResult:
    """The token after a prompt, from the target's logit vector [vocab] there."""
    scores = logits[None]
    if sampling.processors is not None:
        scores = process_block(scores, sampling.processors, prompt, (), ())
    if sampling.greedy:
        token = int(greedy(scores[0]).item())
    else:
        token = sample(row_probabilities(scores, sampling)[0], sampling.generator)
    return RowResult([token], 0, 0, _logprobs(logits[None], [token], sampling))


def _logprobs(
    raw: Tensor, token_ids: list[int], sampling: RowSampling
) -> list[TokenLogprob] | None:
    return None if sampling.logprobs is None else token_logprobs(raw, token_ids, sampling.logprobs)


def _prompt_batch(
    rows: list[PrefillRow], starts: list[int]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Right-padded ids, positions, valid [b, width] and the last index [b, 1]."""
    lengths = [len(r.token_ids) for r in rows]
    if min(lengths) < 1:
        raise ValueError("prefill needs at least one token per row")
    width = max(lengths)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : lengths[i]] = torch.tensor(row.token_ids, dtype=torch.long)
    offsets = torch.arange(width)[None, :]  # [1, width]
    lens = torch.tensor(lengths)[:, None]  # [b, 1]
    valid = offsets < lens  # [b, width]
    positions = torch.tensor(starts)[:, None] + torch.minimum(offsets, lens - 1)  # pads repeat
    return ids, positions, valid, lens - 1


@torch.inference_mode()
def prefill(
    state: SpecState, rows: list[PrefillRow], sampling: list[RowSampling]
) -> list[RowResult]:
    """Run the target over each prompt (appended after whatever the slot already holds),
    fill target + drafter context caches, and return the first token per row."""
    if not rows:
        return []
    dev = state.device
    starts = [state.caches.target.length(r.slot) for r in rows]
    ids, positions, valid, last = (t.to(dev) for t in _prompt_batch(rows, starts))
    slots = torch.tensor([r.slot for r in rows], device=dev)
    # Prompt logprobs need the logits at every prompt position, not only the last.
    every = any(s.prompt_logprobs is not None for s in sampling)
    out = state.target(
        ids,
        positions,
        valid,
        state.caches.target,
        slots,
        state.layer_ids(),
        logit_index=None if every else last,
    )
    if state.drafter is not None and state.caches.drafter is not None and out.hidden is not None:
        state.drafter.append_context(out.hidden, positions, valid, state.caches.drafter, slots)
    for row, start in zip(rows, starts, strict=True):
        state.caches.set_length(row.slot, start + len(row.token_ids))
    results = []
    for i, (row, s) in enumerate(zip(rows, sampling, strict=True)):
        n = len(row.token_ids)
        first = _first_token(out.logits[i, n - 1 if every else 0], row.token_ids, s)
        if s.prompt_logprobs is not None:  # position j predicts prompt token j + 1
            scored = token_logprobs(out.logits[i], row.token_ids[1:], s.prompt_logprobs)
            first = replace(first, prompt_logprobs=scored)
        results.append(first)
    return results


def _propose(
    state: SpecState,
    rows: list[DecodeRow],
    block: Tensor,
    positions: Tensor,
    slots: Tensor,
    index: CacheIndex | None = None,
) -> None:
    """Fill block[:, 1:] with the drafter's argmax proposals (one forward for all rows)."""
    assert state.drafter is not None and state.caches.drafter is not None
    hosts = [r.position for r in rows]
    lengths = torch.tensor(hosts, device=state.device)
    hidden = state.drafter.draft_hidden(
        block, positions, state.caches.drafter, slots, lengths, index=index, lengths=hosts
    )
    block[:, 1:] = greedy(state.drafter.logits(hidden[:, 1:]))  # [b, B-1]


def accept_greedy(target_choice: list[int], drafts: list[int]) -> tuple[int, int]:
    """target_choice: the target's argmax at each of the B block positions; drafts: the
    B-1 proposals. Returns (accepted drafts, bonus token)."""
    n = 0
    while n < len(drafts) and drafts[n] == target_choice[n]:
        n += 1
    return n, target_choice[n]


def accept_sampled(
    probs: Tensor, drafts: list[int], generator: torch.Generator | None
) -> tuple[int, int]:
    """probs [B, vocab]: the target's processed distribution at each block position.
    Draft x at position i is accepted with probability probs[i, x]; on rejection the
    bonus is drawn from probs[i] with x zeroed and renormalised; if all are accepted the
    bonus is drawn from probs[B-1]. Returns (accepted drafts, bonus token)."""
    for i, x in enumerate(drafts):
        if uniform(generator) < float(probs[i, x]):
            continue
        residual = probs[i].clone()
        residual[x] = 0.0
        if float(residual.sum()) <= 0.0:  # unreachable in exact arithmetic (p(x) = 1)
            return i, x
        return i, sample(residual / residual.sum(), generator)
    return len(drafts), sample(probs[len(drafts)], generator)


def _processed(
    logits: Tensor, rows: list[DecodeRow], drafts: list[list[int]], sampling: list[RowSampling]
) -> Tensor:
    """logits [b, B, vocab] with each row's logits processors applied (a copy if any)."""
    todo = [i for i, s in enumerate(sampling) if s.processors is not None]
    if not todo:
        return logits
    out = logits.float().clone()
    for i in todo:
        proc = sampling[i].processors
        assert proc is not None
        width = len(drafts[i]) + 1
        out[i, :width] = process_block(
            logits[i, :width], proc, rows[i].prompt, rows[i].output, drafts[i]
        )
    return out


def _decide(
    logits: Tensor, drafts: list[list[int]], sampling: list[RowSampling]
) -> list[tuple[int, int]]:
    """Processed logits [b, B, vocab] -> per row (accepted drafts, bonus)."""
    choices = greedy(logits).tolist()  # one host transfer for every greedy row
    return [
        accept_greedy(choices[i], drafts[i])
        if s.greedy
        else accept_sampled(row_probabilities(logits[i], s), drafts[i], s.generator)
        for i, s in enumerate(sampling)
    ]


@dataclass
class StepTimings:
    """Seconds spent in each phase of one `spec_step` (filled when one is passed)."""

    prepare: float = 0.0  # host lists -> tensors, cache index
    draft: float = 0.0  # drafter forward + argmax
    verify: float = 0.0  # target forward over the block
    accept: float = 0.0  # argmax / probabilities, acceptance, one host transfer
    context: float = 0.0  # drafter context K/V for the committed positions
    commit: float = 0.0  # slot lengths (commit + rollback), results

    def add(self, other: StepTimings) -> None:
        for name in ("prepare", "draft", "verify", "accept", "context", "commit"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def total(self) -> float:
        return self.prepare + self.draft + self.verify + self.accept + self.context + self.commit


def max_draft_tokens(state: SpecState) -> int:
    """The most draft tokens one step can verify (block_size - 1; 0 without a drafter)."""
    return state.block_size - 1 if state.drafter is not None else 0


@torch.inference_mode()
def spec_step(
    state: SpecState,
    rows: list[DecodeRow],
    sampling: list[RowSampling],
    num_draft: int | None = None,
    timings: StepTimings | None = None,
) -> list[RowResult]:
    """One decoding step for every row: draft, verify, accept, commit, roll back.

    `num_draft`: draft tokens to verify this step, 0..max_draft_tokens(state) (None = the
    most). 0 is plain decoding through the same path (the drafter context still grows by
    the committed token, so speculation can resume on the next step)."""
    if not rows:
        return []
    top = max_draft_tokens(state)
    k = top if num_draft is None else num_draft
    if not 0 <= k <= top:
        raise ValueError(f"num_draft must be in [0, {top}], got {num_draft}")
    clock = time.perf_counter if timings is not None else None
    t0 = clock() if clock else 0.0
    size, dev = k + 1, state.device
    hosts = [r.position for r in rows]
    for r in rows:
        if r.position + size > state.caches.target.capacity:
            raise ValueError(f"slot {r.slot}: position {r.position} + block exceeds capacity")
    slot_list = [r.slot for r in rows]
    starts = torch.tensor(hosts, device=dev)
    positions = starts[:, None] + torch.arange(size, device=dev)[None, :]  # [b, B]
    index = CacheIndex.build(slot_list, hosts, positions, None, dev)
    mask_id = state.drafter.mask_token_id if state.drafter is not None else 0
    block = torch.full((len(rows), size), mask_id, dtype=torch.long, device=dev)
    block[:, 0] = torch.tensor([r.last_token for r in rows], device=dev)
    t1 = clock() if clock else 0.0
    if size > 1:
        _propose(state, rows, block, positions, index.slots, index=index)
    t2 = clock() if clock else 0.0
    out = state.target(
        block,
        positions,
        None,
        state.caches.target,
        index.slots,
        state.layer_ids(),
        index=index,
        kv_len=max(hosts) + size,
    )
    t3 = clock() if clock else 0.0
    drafts = block[:, 1:].tolist()
    decisions = _decide(_processed(out.logits, rows, drafts, sampling), drafts, sampling)
    t4 = clock() if clock else 0.0
    accepted = [n for n, _ in decisions]
    if state.drafter is not None and state.caches.drafter is not None and out.hidden is not None:
        _append_committed(state, out.hidden, positions, index, hosts, accepted)
    t5 = clock() if clock else 0.0
    results = []
    for i, (row, draft, (n, bonus)) in enumerate(zip(rows, drafts, decisions, strict=True)):
        state.caches.set_length(row.slot, row.position + n + 1)  # commit + roll back
        tokens = [*draft[:n], bonus]
        logprobs = _logprobs(out.logits[i], tokens, sampling[i])
        results.append(RowResult(tokens, num_drafted=k, num_accepted=n, logprobs=logprobs))
    if timings is not None and clock is not None:
        t6 = clock()
        timings.add(StepTimings(t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5))
    return results


def _append_committed(
    state: SpecState,
    hidden: Tensor,
    positions: Tensor,
    index: CacheIndex,
    hosts: list[int],
    accepted: list[int],
) -> None:
    """Drafter context for the committed block positions: last_token and the accepted
    drafts. Only the columns some row committed are projected."""
    assert state.drafter is not None and state.caches.drafter is not None
    width = max(accepted) + 1
    hidden, positions = hidden[:, :width], positions[:, :width]
    top = max(hosts) + width - 1
    if len(hosts) == 1:  # one row: every kept column is committed
        assert index.block is not None
        state.drafter.append_context(
            hidden,
            positions,
            None,
            state.caches.drafter,
            index.slots,
            index=index,
            max_position=top,
        )
        return
    counts = torch.tensor(accepted, device=state.device)
    valid = torch.arange(width, device=state.device)[None, :] <= counts[:, None]  # [b, w]
    state.drafter.append_context(
        hidden, positions, valid, state.caches.drafter, index.slots, max_position=top
    )
