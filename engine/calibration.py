"""Start-up measurement of step costs for the adaptive policy (engine.adaptive.CostModel).

Runs real `spec_step`s on scratch rows in slots 0..b-1, so it must run before any request
is admitted (every slot free); the slots are released afterwards. Every grid cell is
measured once per pass and the passes go round the whole grid step by step, so a burst
of load from another process lands on one sample of many cells rather than on all the
samples of one; each cell keeps its fastest sample (other processes only ever add time,
and the policy needs the steps' relative costs). The rows do not advance between steps
(same positions each time: what a step writes past a row's length is dead), so every
cell sees the same context. After the grid, the drafter context of the rows' prompts is
dropped and projected again (`catch_up`) a few times: the per-position cost of catching
up context that plain steps put off.
"""

from __future__ import annotations

import time

from engine.adaptive import CostModel, default_grid
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


def measure_grid(
    state: SpecState,
    batch_sizes: list[int],
    num_drafts: list[int],
    *,
    context_tokens: int = 128,
    passes: int = 6,
    vocab: int = 256,
) -> tuple[dict[tuple[int, int], float], float]:
    """Fastest wall seconds of a step per (batch size, k), over `passes` interleaved passes
    (after one warm-up pass), and the fastest seconds per position of a catch-up of every
    row's prompt context (0.0 without a drafter)."""
    top_b = max(batch_sizes)
    if top_b > state.caches.target.num_slots:
        slots = state.caches.target.num_slots
        raise ValueError(f"batch size {top_b} exceeds the {slots} slots")
    room = state.caches.target.capacity - max(num_drafts) - 1
    context = max(1, min(context_tokens, room))
    prompts = [[(7 * i + j) % vocab + 1 for j in range(context)] for i in range(top_b)]
    best: dict[tuple[int, int], float] = {}
    try:
        firsts = prefill(state, [PrefillRow(i, p) for i, p in enumerate(prompts)], [GREEDY] * top_b)
        rows = [DecodeRow(i, firsts[i].token_ids[0], context) for i in range(top_b)]
        for n in range(passes + 1):
            for b in batch_sizes:
                for k in num_drafts:
                    start = time.perf_counter()
                    spec_step(state, rows[:b], [GREEDY] * b, num_draft=k)
                    seconds = time.perf_counter() - start
                    if n:  # pass 0 warms up
                        best[(b, k)] = min(seconds, best.get((b, k), seconds))
        per_position = _catch_up_seconds(state, rows, passes) / (top_b * context)
    finally:
        for i in range(top_b):
            release(state, i)
    return best, per_position


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
    passes: int = 6,
) -> CostModel:
    """The cost model of this state on the default grid (about 10 s for the bundled
    tiny-coder with 16 slots on a busy 2-core machine), made monotone."""
    seqs = state.caches.target.num_slots if max_num_seqs is None else max_num_seqs
    batch_sizes, num_drafts = default_grid(seqs, max_draft_tokens(state))
    best, per_position = measure_grid(
        state, batch_sizes, num_drafts, context_tokens=context_tokens, passes=passes
    )
    seconds = tuple(tuple(best[(b, k)] for k in num_drafts) for b in batch_sizes)
    return CostModel(tuple(batch_sizes), tuple(num_drafts), seconds, per_position).monotone()
