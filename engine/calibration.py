"""Start-up measurement of step costs for the adaptive policy (engine.adaptive.CostModel).

Runs real `spec_step`s on scratch rows in slots 0..b-1, so it must run before any request
is admitted (every slot free); the slots are released afterwards.
"""

from __future__ import annotations

import time

from engine.adaptive import CostModel, calibrate, default_grid
from engine.speculative import (
    DecodeRow,
    PrefillRow,
    RowSampling,
    SpecState,
    max_draft_tokens,
    prefill,
    release,
    spec_step,
)

GREEDY = RowSampling(temperature=0.0)


def step_seconds(
    state: SpecState,
    batch_size: int,
    num_draft: int,
    *,
    context_tokens: int = 128,
    steps: int = 4,
    vocab: int = 256,
) -> float:
    """Fastest wall seconds of `steps` steps verifying `num_draft` drafts for
    `batch_size` rows that start with `context_tokens` of context (one warm-up step).
    The minimum, not the mean: other processes only ever add time, and the policy
    needs the steps' relative costs."""
    if batch_size > state.caches.target.num_slots:
        slots = state.caches.target.num_slots
        raise ValueError(f"batch size {batch_size} exceeds the {slots} slots")
    room = state.caches.target.capacity - (steps + 2) * (num_draft + 1)
    context = max(1, min(context_tokens, room))
    prompts = [[(7 * i + j) % vocab + 1 for j in range(context)] for i in range(batch_size)]
    firsts = prefill(
        state, [PrefillRow(i, p) for i, p in enumerate(prompts)], [GREEDY] * batch_size
    )
    rows = [DecodeRow(i, firsts[i], context) for i in range(batch_size)]
    times = []
    try:
        for step in range(steps + 1):
            start = time.perf_counter()
            results = spec_step(state, rows, [GREEDY] * batch_size, num_draft=num_draft)
            if step:  # the first is a warm-up
                times.append(time.perf_counter() - start)
            rows = [
                DecodeRow(r.slot, res.token_ids[-1], r.position + len(res.token_ids))
                for r, res in zip(rows, results, strict=True)
            ]
    finally:
        for i in range(batch_size):
            release(state, i)
    return min(times)


def calibrate_state(
    state: SpecState,
    max_num_seqs: int | None = None,
    *,
    context_tokens: int = 128,
    steps: int = 4,
    passes: int = 3,
) -> CostModel:
    """The cost model of this state on the default grid, `passes` interleaved passes
    (about 10 s for the bundled tiny-coder with 16 slots on one core)."""
    seqs = state.caches.target.num_slots if max_num_seqs is None else max_num_seqs
    batch_sizes, num_drafts = default_grid(seqs, max_draft_tokens(state))

    def measure(b: int, k: int) -> float:
        return step_seconds(state, b, k, context_tokens=context_tokens, steps=steps)

    return calibrate(measure, batch_sizes, num_drafts, passes)
