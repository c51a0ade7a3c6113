"""Speculative step: greedy output with the drafter == plain decoding, token for token."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from engine import speculative
from engine.drafter import DFlashDrafter
from engine.model import Qwen3Target
from engine.speculative import (
    DecodeRow,
    PrefillRow,
    RowResult,
    RowSampling,
    SpecState,
    prefill,
    release,
    spec_step,
)
from tests.fixtures.tiny_models import (
    make_agreeable,
    random_drafter,
    random_target,
    tiny_target_config,
)

VOCAB, MAX_LEN, NEW_TOKENS = 64, 48, 14
GREEDY = RowSampling(temperature=0.0)
Models = tuple[Qwen3Target, dict[int, DFlashDrafter]]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny ops: intra-op threads only add contention on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _models(agreeable: bool) -> Models:
    target = random_target(tiny_target_config(VOCAB, 4, tie_word_embeddings=False), seed=0)
    drafters = {b: random_drafter(target, block_size=b, seed=b) for b in (2, 4, 8, 16)}
    if agreeable:
        for drafter in drafters.values():  # same target edits each time; drafters differ
            make_agreeable(target, drafter, body_scale=0.3 ** (1 / len(drafters)))
    return target, drafters


@pytest.fixture(scope="module")
def agreeable() -> Models:
    return _models(agreeable=True)


@pytest.fixture(scope="module")
def disagreeable() -> Models:
    return _models(agreeable=False)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(42)
    lengths = torch.randint(2, 13, (6,), generator=gen).tolist()
    return [torch.randint(0, VOCAB - 1, (n,), generator=gen).tolist() for n in lengths]


def generate(state: SpecState, prompts: list[list[int]], max_rows: int, together: bool,
             results: list[RowResult] | None = None, n: int = NEW_TOKENS) -> list[list[int]]:
    """Continuous batching at the spec_step level: up to max_rows slots, rows join (one per
    step unless `together`) and leave as they finish; slots are released and reused."""
    pending, free = list(enumerate(prompts)), list(range(max_rows))
    active: dict[int, tuple[int, list[int], DecodeRow]] = {}
    done: dict[int, list[int]] = {}
    for _ in range(10_000):
        if not pending and not active:
            break
        joining = []
        while pending and free and (together or not joining):
            joining.append((pending.pop(0), free.pop(0)))
        new_rows = [PrefillRow(s, p) for (_, p), s in joining]
        firsts = prefill(state, new_rows, [GREEDY] * len(joining))
        for ((idx, p), slot), first in zip(joining, firsts, strict=True):
            active[slot] = (idx, [first], DecodeRow(slot, first, len(p)))
        rows = [a[2] for a in active.values()]
        step = spec_step(state, rows, [GREEDY] * len(rows))
        if results is not None:
            results.extend(step)
        for row, res in zip(rows, step, strict=True):
            idx, toks, _ = active[row.slot]
            toks.extend(res.token_ids)
            if len(toks) >= n:
                done[idx] = toks[:n]
                release(state, row.slot)
                free.append(row.slot)
                del active[row.slot]
            else:
                nxt = DecodeRow(row.slot, toks[-1], row.position + len(res.token_ids))
                active[row.slot] = (idx, toks, nxt)
    return [done[i] for i in range(len(prompts))]


def _plain(target: Qwen3Target, prompts: list[list[int]], n: int = NEW_TOKENS
           ) -> list[list[int]]:
    state = SpecState.create(target, None, len(prompts), MAX_LEN, 1, "cpu", torch.float32)
    return generate(state, prompts, len(prompts), True, n=n)


@pytest.fixture(scope="module")
def agreeable_plain(agreeable: Models, prompts: list[list[int]]) -> list[list[int]]:
    return _plain(agreeable[0], prompts)


@pytest.fixture(scope="module")
def disagreeable_plain(disagreeable: Models, prompts: list[list[int]]) -> list[list[int]]:
    return _plain(disagreeable[0], prompts)


MODES = {"unbatched": (1, False), "batched": (6, True), "staggered": (3, False)}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_greedy_speculation_equals_plain_decoding(
        agreeable: Models, prompts: list[list[int]], agreeable_plain: list[list[int]],
        block_size: int, mode: str) -> None:
    target, drafters = agreeable
    expected = agreeable_plain
    max_rows, together = MODES[mode]
    state = SpecState.create(target, drafters[block_size], max_rows, MAX_LEN, block_size,
                             "cpu", torch.float32)
    results: list[RowResult] = []
    assert generate(state, prompts, max_rows, together, results) == expected
    assert all(r.num_drafted == block_size - 1 for r in results)
    assert all(r.num_accepted == len(r.token_ids) - 1 for r in results)
    assert sum(r.num_accepted for r in results) > 0, "the drafter never agreed: test is vacuous"


def test_random_drafter_rejects_almost_everything_and_stays_exact(
        disagreeable: Models, prompts: list[list[int]],
        disagreeable_plain: list[list[int]]) -> None:
    target, drafters = disagreeable
    state = SpecState.create(target, drafters[4], 4, MAX_LEN, 4, "cpu", torch.float32)
    assert generate(state, prompts, 4, True) == disagreeable_plain


def _oracle(history: dict[int, list[int]], gen: torch.Generator) -> Callable[..., None]:
    """A drafter stand-in proposing the true greedy continuation, with one random token
    corrupted at a random place (or none), so every acceptance length occurs."""

    def propose(state: SpecState, rows: list[DecodeRow], block: torch.Tensor,
                positions: torch.Tensor, slots: torch.Tensor) -> None:
        size = block.shape[1]
        for i, row in enumerate(rows):
            seq = history[row.slot]
            truth = [seq[p] if p < len(seq) else 0 for p in range(row.position + 1,
                                                                   row.position + size)]
            bad = int(torch.randint(0, size, (1,), generator=gen))
            if bad < size - 1:
                truth[bad] = (truth[bad] + 1) % VOCAB
            block[i, 1:] = torch.tensor(truth)

    return propose


@pytest.mark.parametrize("block_size", [4, 16])
def test_long_acceptances_commit_and_roll_back_exactly(
        monkeypatch: pytest.MonkeyPatch, disagreeable: Models, prompts: list[list[int]],
        disagreeable_plain: list[list[int]], block_size: int) -> None:
    target, drafters = disagreeable
    expected = disagreeable_plain
    longer = _plain(target, prompts, NEW_TOKENS + block_size)  # truth beyond the last block
    plain_runs = [p + e for p, e in zip(prompts, longer, strict=True)]
    history = dict(enumerate(plain_runs))  # slot i serves prompt i (all join together)
    monkeypatch.setattr(speculative, "_propose", _oracle(history, torch.Generator().manual_seed(0)))
    state = SpecState.create(target, drafters[block_size], 6, MAX_LEN, block_size, "cpu",
                             torch.float32)
    results: list[RowResult] = []
    assert generate(state, prompts, 6, True, results) == expected
    lengths = {r.num_accepted for r in results}
    assert block_size - 1 in lengths and 0 in lengths and len(lengths) >= 3


def test_no_drafter_or_block_size_one_is_plain_decoding(agreeable: Models) -> None:
    target, drafters = agreeable
    for drafter, size in ((None, 4), (drafters[4], 1)):
        state = SpecState.create(target, drafter, 2, MAX_LEN, size, "cpu", torch.float32)
        assert state.block_size == 1 and state.drafter is None and state.caches.drafter is None
        first = prefill(state, [PrefillRow(0, [1, 2, 3])], [GREEDY])[0]
        (res,) = spec_step(state, [DecodeRow(0, first, 3)], [GREEDY])
        assert len(res.token_ids) == 1 and res.num_drafted == 0 and res.num_accepted == 0
        assert state.caches.target.length(0) == 4


def test_step_at_the_context_limit_fits_and_usage_is_reported(agreeable: Models) -> None:
    target, drafters = agreeable
    state = SpecState.create(target, drafters[16], 2, 24, 16, "cpu", torch.float32)
    prompt = list(range(1, 24))  # 23 tokens: the first sampled token is at position 23
    first = prefill(state, [PrefillRow(1, prompt)], [GREEDY])[0]
    assert state.kv_cache_usage() == pytest.approx(23 / (2 * (24 + 16)))
    (res,) = spec_step(state, [DecodeRow(1, first, 23)], [GREEDY])
    assert 1 <= len(res.token_ids) <= 16
    assert state.caches.target.length(1) == state.caches.drafter.length(1) == 24 + res.num_accepted
    release(state, 1)
    assert state.kv_cache_usage() == 0.0
