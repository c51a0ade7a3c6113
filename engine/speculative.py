"""The tensor work of one engine step: prefill, one batched speculative step, release.

A step over rows (one running request each, in its own cache slot):
1. ONE drafter forward over every row's block [last, MASK, ...] gives block_size - 1
   deterministic draft tokens per row (DFlash: the argmax at each position; DFlash2: the
   candidate selector's greedy path, engine/dflash2.py).
2. ONE target forward verifies every block on top of the rows' target caches.
3. Per row: the row's logits processors (penalties, logit bias, bad words, ...) run
   position by position, each position seeing the history it extends
   (logits_processors.py); greedy rows accept the longest prefix matching the processed
   argmax; sampled rows accept draft x with probability p(x) and otherwise sample from p
   with x removed (renormalised). Either way one bonus token from the target follows.
   Since the drafts are deterministic this keeps the output distribution exactly the
   target's. Rows that asked for log-probabilities get the target's at each committed
   token (logprobs.py).
4. Commit: after a drafting step, the target hidden states of the committed block
   positions become drafter context (K/V in its cache); rollback: both caches' slot
   lengths are set back.
block_size 1 (or no drafter) runs the same code as plain decoding.

Drafter context is work only speculation needs, so prefill and plain steps (k = 0) do not
project it: they store the target's features at the drafter's layers (`PendingFeatures`)
and the next step that drafts for the row first projects every missing position of every
row in one batched pass (`catch_up`). A row that ran plain steps for a while then drafts
from exactly the context it would have had.

Invariant between steps: for a running slot, target length == position of `last_token`,
which is committed but not yet in any cache; the drafter context covers a prefix of it
and the pending features the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from engine.drafter import DFlashDrafter
from engine.kv_cache import CacheIndex, PendingFeatures, SlotCaches
from engine.logits_processors import process_block
from engine.logprobs import TokenLogprob, token_logprobs
from engine.model import Qwen3Target
from engine.sampling import (
    RowSampling,
    draw,
    greedy,
    keyed_token,
    row_probabilities,
    sample,
    uniform,
)

__all__ = [
    "DecodeRow",
    "PrefillRow",
    "RowResult",
    "RowSampling",
    "SpecState",
    "StepTimings",
    "TokenLogprob",
    "accept_greedy",
    "accept_keyed",
    "accept_sampled",
    "catch_up",
    "max_draft_tokens",
    "move_slot",
    "pending_context",
    "phase_clock",
    "prefill",
    "release",
    "row_probabilities",
    "spec_step",
    "swap_slots",
    "synchronize",
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
        draft_cache, pending = None, None
        if active is not None:
            draft_cache = active.new_cache(max_num_seqs, capacity, device, active.dtype)
            width = len(active.config.target_layer_ids) * target.config.hidden_size
            pending = PendingFeatures(max_num_seqs, capacity, width, device, dtype)
        return cls(
            target=target,
            drafter=active,
            caches=SlotCaches(target_cache, draft_cache, pending),
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


@torch.inference_mode()
def move_slot(state: SpecState, src: int, dst: int) -> None:
    """Move a running row's caches from slot `src` into the free slot `dst`."""
    state.caches.move(src, dst)


@torch.inference_mode()
def swap_slots(state: SpecState, a: int, b: int) -> None:
    """Exchange two running rows' caches."""
    state.caches.swap(a, b)


def _first_token(
    logits: Tensor, prompt: list[int], sampling: RowSampling, position: int
) -> RowResult:
    """The token after a prompt, at sequence `position`, from the target's logit vector
    [vocab] there."""
    scores = logits[None]
    if sampling.processors is not None:
        scores = process_block(scores, sampling.processors, prompt, (), ())
    if sampling.greedy:
        token = int(greedy(scores[0]).item())
    else:
        token = draw(row_probabilities(scores, sampling)[0], sampling, position)
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
    fill the target cache and the drafter's pending features, and return the first token
    per row."""
    if not rows:
        return []
    dev = state.device
    starts = [state.caches.target.length(r.slot) for r in rows]
    ids, positions, valid, last = (t.to(dev) for t in _prompt_batch(rows, starts))
    index = CacheIndex.build([r.slot for r in rows], starts, positions, valid, dev)
    # Prompt logprobs need the logits at every prompt position, not only the last.
    every = any(s.prompt_logprobs is not None for s in sampling)
    out = state.target(
        ids,
        positions,
        valid,
        state.caches.target,
        index.slots,
        state.layer_ids(),
        logit_index=None if every else last,
        index=index,
    )
    _keep_pending(state, index, out.hidden)
    for row, start in zip(rows, starts, strict=True):
        state.caches.set_length(row.slot, start + len(row.token_ids))
    results = []
    for i, (row, s) in enumerate(zip(rows, sampling, strict=True)):
        n = len(row.token_ids)
        logits = out.logits[i, n - 1 if every else 0]
        first = _first_token(logits, row.token_ids, s, starts[i] + n)
        if s.prompt_logprobs is not None:  # position j predicts prompt token j + 1
            scored = token_logprobs(out.logits[i], row.token_ids[1:], s.prompt_logprobs)
            first = replace(first, prompt_logprobs=scored)
        results.append(first)
    return results


def _keep_pending(state: SpecState, index: CacheIndex, hidden: Tensor | None) -> None:
    """Store the target's features at the drafter's layers for a later `catch_up`."""
    if state.caches.pending is not None and hidden is not None:
        state.caches.pending.write_at(index, hidden)


def synchronize(state: SpecState) -> None:
    """Wait for the device's queued work (a step's timing must not absorb the previous
    call's kernels; nothing to wait for on a CPU)."""
    if state.device.type == "cuda":
        torch.cuda.synchronize(state.device)


def phase_clock(state: SpecState) -> Callable[[], float]:
    """The clock `spec_step` reads between phases when asked for timings: on a GPU it waits
    for the queued kernels first, so each phase holds its own device time (not launches)."""
    if state.device.type != "cuda":
        return time.perf_counter

    def synced() -> float:
        synchronize(state)
        return time.perf_counter()

    return synced


def pending_context(state: SpecState, rows: Sequence[DecodeRow]) -> int:
    """Positions of these rows whose drafter context a drafting step must project first."""
    return sum(r.position - state.caches.lag(r.slot, r.position) for r in rows)


@torch.inference_mode()
def catch_up(state: SpecState, rows: Sequence[DecodeRow]) -> int:
    """Project every row's pending features into the drafter's context, all rows in one
    flat pass (the projection is per position: no padding). Returns positions projected."""
    caches = state.caches
    if state.drafter is None or caches.drafter is None or caches.pending is None:
        return 0
    spans = [(r.slot, caches.lag(r.slot, r.position), r.position) for r in rows]
    spans = [span for span in spans if span[1] < span[2]]
    if not spans:
        return 0
    dev = state.device
    if len(spans) == 1:  # one row: slices, no gather
        slot, start, end = spans[0]
        positions = torch.arange(start, end, device=dev)[None, :]  # [1, n]
        index = CacheIndex.build([slot], [start], positions, None, dev)
        features = caches.pending.features[slot, start:end][None]  # [1, n, width]
    else:
        slots = torch.tensor([slot for slot, _, _ in spans], device=dev)
        counts = torch.tensor([end - start for _, start, end in spans], device=dev)
        firsts = torch.tensor([start for _, start, _ in spans], device=dev)
        flat_rows = slots.repeat_interleave(counts)  # [n] slot of each missing position
        offsets = (torch.cumsum(counts, 0) - counts).repeat_interleave(counts)
        pos = firsts.repeat_interleave(counts) + torch.arange(len(flat_rows), device=dev) - offsets
        index = CacheIndex(slots, None, None, flat_rows, pos, None)
        positions, features = pos[None, :], caches.pending.gather(flat_rows, pos)[None]
    top = max(end for _, _, end in spans) - 1
    state.drafter.append_context(
        features, positions, None, caches.drafter, index.slots, index=index, max_position=top
    )
    for slot, _, end in spans:
        caches.drafter.set_length(slot, end)
    return sum(end - start for _, start, end in spans)


def _propose(
    state: SpecState,
    rows: list[DecodeRow],
    block: Tensor,
    positions: Tensor,
    slots: Tensor,
    index: CacheIndex | None = None,
) -> None:
    """Fill block[:, 1:] with the drafter's proposals (one forward for all rows): DFlash's
    argmax per position, DFlash2's selector path (both deterministic)."""
    assert state.drafter is not None and state.caches.drafter is not None
    hosts = [r.position for r in rows]
    lengths = torch.tensor(hosts, device=state.device)
    hidden = state.drafter.draft_hidden(
        block, positions, state.caches.drafter, slots, lengths, index=index, lengths=hosts
    )
    block[:, 1:] = state.drafter.propose(block[:, 0], hidden)  # [b, B-1]


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


def accept_keyed(probs: Tensor, drafts: list[int], seed: int, position: int) -> tuple[int, int]:
    """A seeded row's acceptance. probs [B, vocab] as in accept_sampled; `position`: the
    sequence position of the block's first new token. The target's own sample at each
    position is keyed by (seed, position) (sampling.keyed_token), and a draft is accepted
    when it equals that sample: the committed text is the target's keyed samples, the same
    whatever the step verifies, so a seed's text does not depend on the plan.

    Lossless and as accepting as accept_sampled: a draft x (deterministic) is accepted with
    probability P(sample = x) = probs[i, x], and a rejection's bonus is the sample given it
    differs from x, distributed as probs[i] without x, renormalised."""
    for i, x in enumerate(drafts):
        token = keyed_token(probs[i], seed, position + i)
        if token != x:
            return i, token
    return len(drafts), keyed_token(probs[len(drafts)], seed, position + len(drafts))


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
    logits: Tensor, rows: list[DecodeRow], drafts: list[list[int]], sampling: list[RowSampling]
) -> list[tuple[int, int]]:
    """Processed logits [b, B, vocab] -> per row (accepted drafts, bonus)."""
    choices = greedy(logits).tolist()  # one host transfer for every greedy row
    decisions = []
    for i, s in enumerate(sampling):
        if s.greedy:
            decisions.append(accept_greedy(choices[i], drafts[i]))
            continue
        probs = row_probabilities(logits[i], s)
        if s.seed is not None:  # the token after `last_token` sits at position + 1
            decisions.append(accept_keyed(probs, drafts[i], s.seed, rows[i].position + 1))
        else:
            decisions.append(accept_sampled(probs, drafts[i], s.generator))
    return decisions


@dataclass
class StepTimings:
    """Seconds spent in each phase of one `spec_step` (filled when one is passed)."""

    prepare: float = 0.0  # host lists -> tensors, cache index
    draft: float = 0.0  # drafter forward + argmax
    verify: float = 0.0  # target forward over the block
    accept: float = 0.0  # argmax / probabilities, acceptance, one host transfer
    context: float = 0.0  # drafter context K/V for the committed positions
    commit: float = 0.0  # slot lengths (commit + rollback), results
    catch_up: float = 0.0  # drafter context put off by earlier plain steps (and prefill)

    PHASES = ("prepare", "draft", "verify", "accept", "context", "commit", "catch_up")

    def add(self, other: StepTimings) -> None:
        for name in self.PHASES:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def total(self) -> float:
        return float(sum(getattr(self, name) for name in self.PHASES))


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
    most). 0 is plain decoding through the same path, at plain decoding's cost: the drafter
    context is not projected, its features are kept for the next drafting step."""
    if not rows:
        return []
    top = max_draft_tokens(state)
    k = top if num_draft is None else num_draft
    if not 0 <= k <= top:
        raise ValueError(f"num_draft must be in [0, {top}], got {num_draft}")
    clock = phase_clock(state) if timings is not None else None
    tc = clock() if clock else 0.0
    if k > 0:
        catch_up(state, rows)
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
    decisions = _decide(_processed(out.logits, rows, drafts, sampling), rows, drafts, sampling)
    t4 = clock() if clock else 0.0
    accepted = [n for n, _ in decisions]
    drafted = size > 1 and out.hidden is not None
    if drafted:
        assert out.hidden is not None
        _append_committed(state, out.hidden, positions, index, hosts, accepted)
    else:
        _keep_pending(state, index, out.hidden)
    t5 = clock() if clock else 0.0
    results = []
    for i, (row, draft, (n, bonus)) in enumerate(zip(rows, drafts, decisions, strict=True)):
        # commit + roll back
        state.caches.set_length(row.slot, row.position + n + 1, drafted=drafted)
        tokens = [*draft[:n], bonus]
        logprobs = _logprobs(out.logits[i], tokens, sampling[i])
        results.append(RowResult(tokens, num_drafted=k, num_accepted=n, logprobs=logprobs))
    if timings is not None and clock is not None:
        t6 = clock()
        phases = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)
        timings.add(StepTimings(*phases, catch_up=t0 - tc))
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
