"""Start-up measurement of step costs for the adaptive policy (engine.adaptive.CostModel).

Runs real `spec_step`s on scratch rows in slots 0..b-1, so it must run before any request
is admitted (every slot free); the slots are released afterwards. Every grid cell is
measured once per pass and the passes go round the whole grid step by step, so a burst
of load from another process lands on one sample of many cells rather than on all the
samples of one; each cell keeps its fastest sample (other processes only ever add time,
and the policy needs the steps' relative costs). A batch size's first cell, its plain one,
follows the largest step of the batch size before, so it is timed after an untimed step of
its own (`_timed_step`). The rows do not advance between steps (same positions each time:
what a step writes past a row's length is dead), so every cell sees the same context.
After the grid, the drafter context of the rows' prompts is dropped and projected again
(`catch_up`) a few times: the per-position cost of catching up context that plain steps
put off. Last, a few rows at a long context give the slopes of the cost's growth with
context (`ContextTerm`): the grid's context is one of many a live batch has, and a long
context makes plain steps dearer relative to drafting ones.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

from engine.adaptive import ContextTerm, CostModel, default_grid
from engine.speculative import (
    DecodeRow,
    PrefillRow,
    RowSampling,
    SpecState,
    catch_up,
    max_draft_tokens,
    prefill,
    release,
    spec_step,
    synchronize,
)

GREEDY = RowSampling(temperature=0.0)
# A pass that still lowers the grid's summed minima by more than this fraction means the
# passes before it ran on a busier machine (a neighbour starting up, say): measure on, up to
# MORE_PASSES times as many passes again, until a pass finds nothing faster.
SETTLED = 0.02
MORE_PASSES = 2


def measure_grid(
    state: SpecState,
    batch_sizes: list[int],
    num_drafts: list[int],
    *,
    context_tokens: int = 128,
    passes: int = 6,
    vocab: int = 256,
) -> tuple[dict[tuple[int, int], float], float]:
    """Fastest wall seconds of a step per (batch size, k), over at least `passes`
    interleaved passes (after one warm-up pass) and until they settle, and the fastest
    seconds per position of a catch-up of every row's prompt context (0.0 without a
    drafter)."""
    top_b = max(batch_sizes)
    if top_b > state.caches.target.num_slots:
        slots = state.caches.target.num_slots
        raise ValueError(f"batch size {top_b} exceeds the {slots} slots")
    context = max(1, min(context_tokens, _room(state, max(num_drafts))))
    best: dict[tuple[int, int], float] = {}
    try:
        rows = _scratch_rows(state, top_b, context, vocab)
        cells = [(b, k) for b in batch_sizes for k in num_drafts]
        for b, k in cells:  # a warm-up pass
            _timed_step(state, rows[:b], k)
        for n in range(1, passes * (1 + MORE_PASSES) + 1):
            before = sum(best.values()) if best else math.inf
            for b, k in cells:
                seconds = _timed_step(state, rows[:b], k, settle=k == num_drafts[0])
                best[(b, k)] = min(seconds, best.get((b, k), seconds))
            if n >= passes and sum(best.values()) >= (1 - SETTLED) * before:
                break  # the last pass found the grid no faster: the minima have settled
        per_position = _catch_up_seconds(state, rows, passes) / (top_b * context)
    finally:
        for i in range(top_b):
            release(state, i)
    return best, per_position


def measure_context(
    state: SpecState, batch_size: int, num_drafts: list[int], context_tokens: int, passes: int = 6
) -> list[float]:
    """Fastest seconds of a step verifying each of `num_drafts` for `batch_size` rows at
    `context_tokens` of context, interleaved over `passes` (after one warm-up pass)."""
    fastest = [float("inf")] * len(num_drafts)
    try:
        rows = _scratch_rows(state, batch_size, context_tokens, 256)
        for n in range(passes + 1):
            seconds = [_timed_step(state, rows, k, settle=not i) for i, k in enumerate(num_drafts)]
            if n:
                fastest = [min(a, b) for a, b in zip(fastest, seconds, strict=True)]
    finally:
        for i in range(batch_size):
            release(state, i)
    return fastest


def _room(state: SpecState, max_k: int) -> int:
    """The longest context a scratch row can have and still take a step of max_k drafts."""
    return state.caches.target.capacity - max_k - 1


def _scratch_rows(state: SpecState, n: int, context: int, vocab: int) -> list[DecodeRow]:
    """Rows in slots 0..n-1 holding `context` tokens of a deterministic prompt each."""
    vocab = min(vocab, state.target.config.vocab_size - 1)
    prompts = [[(7 * i + j) % vocab + 1 for j in range(context)] for i in range(n)]
    firsts = prefill(state, [PrefillRow(i, p) for i, p in enumerate(prompts)], [GREEDY] * n)
    return [DecodeRow(i, firsts[i].token_ids[0], context) for i in range(n)]


def _timed_step(state: SpecState, rows: list[DecodeRow], k: int, settle: bool = False) -> float:
    """Seconds of a step; with `settle`, timed after an untimed one of the same kind. A
    live step mostly follows steps like it, while a pass puts each batch size's first
    cell, its plain one, right after the largest step of the batch size before: on a CPU
    that read up to a fifth slower (one row: 4.4 against 5.4 ms at the fastest), so plain
    was calibrated dearer than it runs and drafting looked cheaper than it is."""
    if settle:
        spec_step(state, rows, [GREEDY] * len(rows), num_draft=k)
        synchronize(state)
    start = time.perf_counter()
    spec_step(state, rows, [GREEDY] * len(rows), num_draft=k)
    synchronize(state)
    return time.perf_counter() - start


def _catch_up_seconds(state: SpecState, rows: list[DecodeRow], passes: int) -> float:
    """Fastest seconds to project the drafter context of every row's prompt in one pass
    (the prompts' features stay pending: steps only ever write past them)."""
    drafter_cache = state.caches.drafter
    if drafter_cache is None:
        return 0.0
    fastest = float("inf")
    for _ in range(max(1, passes)):
        for row in rows:
            drafter_cache.set_length(row.slot, 0)
        synchronize(state)
        start = time.perf_counter()
        catch_up(state, rows)
        synchronize(state)
        fastest = min(fastest, time.perf_counter() - start)
    return fastest


def calibrate_state(
    state: SpecState,
    max_num_seqs: int | None = None,
    *,
    context_tokens: int = 128,
    long_context: int = 1024,
    passes: int = 6,
) -> CostModel:
    """The cost model of this state on the default grid at `context_tokens`, made
    monotone, with its context term fitted from a few rows at `long_context` (where the
    slots have room for twice the grid's context; else the grid's context throughout)."""
    seqs = state.caches.target.num_slots if max_num_seqs is None else max_num_seqs
    batch_sizes, num_drafts = default_grid(seqs, max_draft_tokens(state))
    best, per_position = measure_grid(
        state, batch_sizes, num_drafts, context_tokens=context_tokens, passes=passes
    )
    seconds = tuple(tuple(best[(b, k)] for k in num_drafts) for b in batch_sizes)
    costs = CostModel(tuple(batch_sizes), tuple(num_drafts), seconds, per_position).monotone()
    short = max(1, min(context_tokens, _room(state, max(num_drafts))))
    long = min(long_context, _room(state, max(num_drafts)))
    if long < 2 * short:
        return costs
    b, k = min(CONTEXT_ROWS, max(batch_sizes)), max(num_drafts)
    if k < 2:
        return costs
    plain, one, drafting = measure_context(state, b, [0, 1, k], long, passes)
    term = ContextTerm.fit(
        short, long, b, k, (best[(b, 0)], plain), (best[(b, 1)], one), (best[(b, k)], drafting)
    )
    return replace(costs, context=term)


# Rows measured at the long context: enough for the per-row and per-query slopes to show,
# few enough that their prefill stays a fraction of the calibration.
CONTEXT_ROWS = 4
