"""Speculative step: greedy output with the drafter == plain decoding, token for token."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from engine import sampling as sampling_module
from engine import speculative
from engine.drafter import DFlashDrafter
from engine.logits_processors import LogitsProcessing, process_block
from engine.model import Qwen3Target
from engine.sampling import sample, uniform
from engine.speculative import (
    DecodeRow,
    PrefillRow,
    RowResult,
    RowSampling,
    SpecState,
    StepTimings,
    catch_up,
    pending_context,
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


def generate(
    state: SpecState,
    prompts: list[list[int]],
    max_rows: int,
    together: bool,
    results: list[RowResult] | None = None,
    n: int = NEW_TOKENS,
    num_draft: Callable[[], int] | None = None,
) -> list[list[int]]:
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
        firsts = [r.token_ids[0] for r in prefill(state, new_rows, [GREEDY] * len(joining))]
        for ((idx, p), slot), first in zip(joining, firsts, strict=True):
            active[slot] = (idx, [first], DecodeRow(slot, first, len(p)))
        rows = [a[2] for a in active.values()]
        k = None if num_draft is None else num_draft()
        step = spec_step(state, rows, [GREEDY] * len(rows), num_draft=k)
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


def _plain(target: Qwen3Target, prompts: list[list[int]], n: int = NEW_TOKENS) -> list[list[int]]:
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
    agreeable: Models,
    prompts: list[list[int]],
    agreeable_plain: list[list[int]],
    block_size: int,
    mode: str,
) -> None:
    target, drafters = agreeable
    expected = agreeable_plain
    max_rows, together = MODES[mode]
    state = SpecState.create(
        target, drafters[block_size], max_rows, MAX_LEN, block_size, "cpu", torch.float32
    )
    results: list[RowResult] = []
    assert generate(state, prompts, max_rows, together, results) == expected
    assert all(r.num_drafted == block_size - 1 for r in results)
    assert all(r.num_accepted == len(r.token_ids) - 1 for r in results)
    assert sum(r.num_accepted for r in results) > 0, "the drafter never agreed: test is vacuous"


@pytest.mark.parametrize("mode", list(MODES))
def test_a_different_number_of_drafts_every_step_equals_plain_decoding(
    agreeable: Models, prompts: list[list[int]], agreeable_plain: list[list[int]], mode: str
) -> None:
    """The adaptive policy's lever: k drafts per step, 0 (plain) to 15, chosen anew each
    step; the drafter context must stay in step with the target through k = 0 steps."""
    target, drafters = agreeable
    max_rows, together = MODES[mode]
    state = SpecState.create(target, drafters[16], max_rows, MAX_LEN, 16, "cpu", torch.float32)
    gen = torch.Generator().manual_seed(11)
    ks: list[int] = []

    def pick() -> int:
        ks.append(int(torch.randint(0, 16, (1,), generator=gen)))
        return ks[-1]

    results: list[RowResult] = []
    assert generate(state, prompts, max_rows, together, results, num_draft=pick) == agreeable_plain
    assert 0 in ks and len(set(ks)) >= 5
    assert {r.num_drafted for r in results} <= set(ks)
    assert sum(r.num_accepted for r in results) > 0


def test_num_draft_out_of_range_is_refused(agreeable: Models) -> None:
    target, drafters = agreeable
    state = SpecState.create(target, drafters[4], 1, MAX_LEN, 4, "cpu", torch.float32)
    first = prefill(state, [PrefillRow(0, [1, 2, 3])], [GREEDY])[0].token_ids[0]
    for bad in (-1, 4):
        with pytest.raises(ValueError, match="num_draft"):
            spec_step(state, [DecodeRow(0, first, 3)], [GREEDY], num_draft=bad)


def test_step_timings_cover_the_phases(agreeable: Models) -> None:
    target, drafters = agreeable
    state = SpecState.create(target, drafters[8], 1, MAX_LEN, 8, "cpu", torch.float32)
    first = prefill(state, [PrefillRow(0, [1, 2, 3])], [GREEDY])[0].token_ids[0]
    timings = StepTimings()
    spec_step(state, [DecodeRow(0, first, 3)], [GREEDY], timings=timings)
    assert timings.draft > 0 and timings.verify > 0 and timings.context > 0
    phases = ("prepare", "draft", "verify", "accept", "context", "commit", "catch_up")
    assert timings.catch_up > 0  # the prompt's drafter context, put off by prefill
    assert timings.total == pytest.approx(sum(getattr(timings, p) for p in phases))


def test_plain_steps_do_no_drafter_work_and_keep_what_catching_up_needs(
    monkeypatch: pytest.MonkeyPatch, agreeable: Models
) -> None:
    target, drafters = agreeable
    drafter = drafters[8]
    state = SpecState.create(target, drafter, 2, MAX_LEN, 8, "cpu", torch.float32)
    rows = [DecodeRow(s, t.token_ids[0], 3) for s, t in enumerate(_prefill_two(state))]

    def forbidden(*_: object, **__: object) -> None:
        raise AssertionError("drafter work in prefill or a plain step")

    with monkeypatch.context() as patch:
        for name in ("append_context", "draft_hidden"):
            patch.setattr(drafter, name, forbidden)
        prefill(state, [PrefillRow(1, [4, 5])], [GREEDY])  # appended to slot 1's prompt
        rows[1] = DecodeRow(1, rows[1].last_token, 5)
        for _ in range(3):
            step = spec_step(state, rows, [GREEDY] * 2, num_draft=0)
            rows = [
                DecodeRow(r.slot, res.token_ids[0], r.position + 1)
                for r, res in zip(rows, step, strict=True)
            ]
    assert state.caches.drafter is not None and state.caches.drafter.lengths[:2] == [0, 0]
    assert pending_context(state, rows) == (3 + 3) + (5 + 3)
    assert catch_up(state, rows) == 14 and pending_context(state, rows) == 0
    assert state.caches.drafter.lengths[:2] == [6, 8]
    assert catch_up(state, rows) == 0  # nothing left: a no-op


def _prefill_two(state: SpecState) -> list[RowResult]:
    return prefill(state, [PrefillRow(0, [1, 2, 3]), PrefillRow(1, [7, 8, 9])], [GREEDY] * 2)


def _history(state: SpecState, prompt: list[int], ks: list[int]) -> tuple[list[int], DecodeRow]:
    """Generate in slot 0 with these draft counts; (committed tokens, the row after)."""
    first = prefill(state, [PrefillRow(0, prompt)], [GREEDY])[0].token_ids[0]
    tokens, row = [first], DecodeRow(0, first, len(prompt))
    for k in ks:
        (res,) = spec_step(state, [row], [GREEDY], num_draft=k)
        tokens += res.token_ids
        row = DecodeRow(0, tokens[-1], row.position + len(res.token_ids))
    return tokens, row


def _drafts(state: SpecState, row: DecodeRow) -> list[int]:
    """What the drafter proposes for `row` (its context must cover the row's position)."""
    size = state.block_size
    block = torch.full((1, size), state.drafter.mask_token_id if state.drafter else 0)
    block[0, 0] = row.last_token
    positions = row.position + torch.arange(size)[None, :]
    speculative._propose(state, [row], block, positions, torch.tensor([row.slot]))
    return block[0, 1:].tolist()


def test_a_row_back_from_plain_steps_drafts_as_one_that_always_drafted(
    agreeable: Models, prompts: list[list[int]]
) -> None:
    """Plain steps then a drafting step (which catches the context up first) propose
    exactly what a row that drafted every step proposes at the same point."""
    target, drafters = agreeable
    prompt = prompts[0]

    def state() -> SpecState:
        return SpecState.create(target, drafters[16], 1, MAX_LEN, 16, "cpu", torch.float32)

    mixed = state()
    tokens, row = _history(mixed, prompt, [0] * 9)  # 10 tokens, the drafter never ran
    assert pending_context(mixed, [row]) == len(prompt) + 9
    always = state()
    drafted, _ = _history(always, prompt, [15] * 10)
    assert drafted[:10] == tokens  # lossless, so the histories agree
    assert always.caches.drafter is not None and always.caches.drafter.length(0) >= row.position
    catch_up(mixed, [row])
    assert mixed.caches.drafter is not None
    for layer in range(len(mixed.caches.drafter.k)):  # the same context K/V ...
        for ours, theirs in (
            (mixed.caches.drafter.k, always.caches.drafter.k),
            (mixed.caches.drafter.v, always.caches.drafter.v),
        ):
            torch.testing.assert_close(
                ours[layer][0, :, : row.position], theirs[layer][0, :, : row.position]
            )
    assert _drafts(mixed, row) == _drafts(always, row)  # ... and the same drafts


def test_random_drafter_rejects_almost_everything_and_stays_exact(
    disagreeable: Models, prompts: list[list[int]], disagreeable_plain: list[list[int]]
) -> None:
    target, drafters = disagreeable
    state = SpecState.create(target, drafters[4], 4, MAX_LEN, 4, "cpu", torch.float32)
    assert generate(state, prompts, 4, True) == disagreeable_plain


def _oracle(history: dict[int, list[int]], gen: torch.Generator) -> Callable[..., None]:
    """A drafter stand-in proposing the true greedy continuation, with one random token
    corrupted at a random place (or none), so every acceptance length occurs."""

    def propose(
        state: SpecState,
        rows: list[DecodeRow],
        block: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        **_: object,
    ) -> None:
        size = block.shape[1]
        for i, row in enumerate(rows):
            seq = history[row.slot]
            truth = [
                seq[p] if p < len(seq) else 0 for p in range(row.position + 1, row.position + size)
            ]
            bad = int(torch.randint(0, size, (1,), generator=gen))
            if bad < size - 1:
                truth[bad] = (truth[bad] + 1) % VOCAB
            block[i, 1:] = torch.tensor(truth)

    return propose


@pytest.mark.parametrize("block_size", [4, 16])
def test_long_acceptances_commit_and_roll_back_exactly(
    monkeypatch: pytest.MonkeyPatch,
    disagreeable: Models,
    prompts: list[list[int]],
    disagreeable_plain: list[list[int]],
    block_size: int,
) -> None:
    target, drafters = disagreeable
    expected = disagreeable_plain
    longer = _plain(target, prompts, NEW_TOKENS + block_size)  # truth beyond the last block
    plain_runs = [p + e for p, e in zip(prompts, longer, strict=True)]
    history = dict(enumerate(plain_runs))  # slot i serves prompt i (all join together)
    monkeypatch.setattr(speculative, "_propose", _oracle(history, torch.Generator().manual_seed(0)))
    state = SpecState.create(
        target, drafters[block_size], 6, MAX_LEN, block_size, "cpu", torch.float32
    )
    results: list[RowResult] = []
    assert generate(state, prompts, 6, True, results) == expected
    lengths = {r.num_accepted for r in results}
    assert block_size - 1 in lengths and 0 in lengths and len(lengths) >= 3


def test_no_drafter_or_block_size_one_is_plain_decoding(agreeable: Models) -> None:
    target, drafters = agreeable
    for drafter, size in ((None, 4), (drafters[4], 1)):
        state = SpecState.create(target, drafter, 2, MAX_LEN, size, "cpu", torch.float32)
        assert state.block_size == 1 and state.drafter is None and state.caches.drafter is None
        first = prefill(state, [PrefillRow(0, [1, 2, 3])], [GREEDY])[0].token_ids[0]
        (res,) = spec_step(state, [DecodeRow(0, first, 3)], [GREEDY])
        assert len(res.token_ids) == 1 and res.num_drafted == 0 and res.num_accepted == 0
        assert state.caches.target.length(0) == 4


def test_step_at_the_context_limit_fits_and_usage_is_reported(agreeable: Models) -> None:
    target, drafters = agreeable
    state = SpecState.create(target, drafters[16], 2, 24, 16, "cpu", torch.float32)
    prompt = list(range(1, 24))  # 23 tokens: the first sampled token is at position 23
    first = prefill(state, [PrefillRow(1, prompt)], [GREEDY])[0].token_ids[0]
    assert state.kv_cache_usage() == pytest.approx(23 / (2 * (24 + 16)))
    (res,) = spec_step(state, [DecodeRow(1, first, 23)], [GREEDY])
    assert 1 <= len(res.token_ids) <= 16
    assert state.caches.target.length(1) == state.caches.drafter.length(1) == 24 + res.num_accepted
    release(state, 1)
    assert state.kv_cache_usage() == 0.0


# ---- sampling is lossless ----------------------------------------------------------------
# Acceptance rule under test: accept deterministic draft x with probability p(x), else
# draw from p with x zeroed and renormalised; bonus from p after the last accepted draft.
# Check: Pearson chi-square of sampled counts against the EXACT target distribution
# (cells with expected count < 5 pooled). Seeds are fixed, so each verdict is
# deterministic; the right rule must give p > 1e-3, a wrong rule p < 1e-6.

PASS_P, FAIL_P = 1e-3, 1e-6
AcceptFn = Callable[[torch.Tensor, list[int], torch.Generator | None], tuple[int, int]]


def chi_square_p(
    counts: dict[tuple[int, ...], int], expected_probs: dict[tuple[int, ...], float]
) -> float:
    """Upper-tail p-value (Wilson-Hilferty approximation of the chi-square law)."""
    n = sum(counts.values())
    stat, df, pooled_obs, pooled_exp = 0.0, -1, 0.0, 0.0
    for cell in set(counts) | set(expected_probs):
        exp, obs = n * expected_probs.get(cell, 0.0), counts.get(cell, 0)
        if exp < 5.0:
            pooled_obs, pooled_exp = pooled_obs + obs, pooled_exp + exp
            continue
        stat, df = stat + (obs - exp) ** 2 / exp, df + 1
    if pooled_exp > 0:
        stat, df = stat + (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9), df + 1
    assert df >= 3, "too few cells for a meaningful test"
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def always_accept(
    probs: torch.Tensor, drafts: list[int], gen: torch.Generator | None
) -> tuple[int, int]:
    return len(drafts), sample(probs[len(drafts)], gen)


def resample_without_removal(
    probs: torch.Tensor, drafts: list[int], gen: torch.Generator | None
) -> tuple[int, int]:
    for i, x in enumerate(drafts):
        if uniform(gen) >= float(probs[i, x]):
            return i, sample(probs[i], gen)  # wrong: x may be drawn again
    return len(drafts), sample(probs[len(drafts)], gen)


def _first_tokens(
    accept: AcceptFn, probs: torch.Tensor, drafts: list[int], samples: int
) -> dict[tuple[int, ...], int]:
    """Emitted tokens of one step, truncated to 3, counted over many seeded draws."""
    gen = torch.Generator().manual_seed(1234)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(samples):
        n, bonus = accept(probs, drafts, gen)
        key = tuple([*drafts[:n], bonus][:3])
        counts[key] = counts.get(key, 0) + 1
    return counts


def _direct_expected(probs: torch.Tensor, drafts: list[int]) -> dict[tuple[int, ...], float]:
    """Exact law of the emitted prefix when the target's conditional at block position i
    (after accepting drafts[:i]) is probs[i]; a non-draft token ends the step."""
    out: dict[tuple[int, ...], float] = {}
    prefix_p = 1.0
    for i in range(3):
        for tok in range(probs.shape[1]):
            p = prefix_p * float(probs[i, tok])
            if i == 2 or tok != drafts[i]:
                out[(*drafts[:i], tok)] = p
        prefix_p *= float(probs[i, drafts[i]])
    return out


@pytest.fixture(scope="module")
def direct_case() -> tuple[torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(7)
    probs = torch.softmax(torch.randn(4, 6, generator=gen) * 1.5, dim=-1)  # [B=4, vocab=6]
    drafts = [int(probs[i].argmax()) if i != 1 else int(probs[i].argsort()[-2]) for i in range(3)]
    return probs, drafts


def test_acceptance_rule_reproduces_the_target_distribution(
    direct_case: tuple[torch.Tensor, list[int]],
) -> None:
    probs, drafts = direct_case
    expected = _direct_expected(probs, drafts)
    assert sum(expected.values()) == pytest.approx(1.0)
    counts = _first_tokens(speculative.accept_sampled, probs, drafts, 8000)
    assert chi_square_p(counts, expected) > PASS_P


def test_keyed_acceptance_reproduces_the_target_distribution(
    direct_case: tuple[torch.Tensor, list[int]],
) -> None:
    """A seeded row's rule (accept a draft when it equals the target's keyed sample): over
    seeds, the same law as the target alone; and one seed always gives the same tokens."""
    probs, drafts = direct_case
    seeds = iter(range(10**6))

    def keyed(
        probs: torch.Tensor, drafts: list[int], gen: torch.Generator | None
    ) -> tuple[int, int]:
        return speculative.accept_keyed(probs, drafts, next(seeds), 40)

    counts = _first_tokens(keyed, probs, drafts, 8000)
    assert chi_square_p(counts, _direct_expected(probs, drafts)) > PASS_P
    once = [speculative.accept_keyed(probs, drafts, 3, 40) for _ in range(3)]
    assert once[0] == once[1] == once[2]


@pytest.mark.parametrize("wrong", [always_accept, resample_without_removal])
def test_the_check_rejects_wrong_acceptance_rules(
    direct_case: tuple[torch.Tensor, list[int]], wrong: AcceptFn
) -> None:
    probs, drafts = direct_case
    counts = _first_tokens(wrong, probs, drafts, 8000)
    assert chi_square_p(counts, _direct_expected(probs, drafts)) < FAIL_P


E2E_PROMPT, E2E_VOCAB = [1, 2, 3], 8
E2E_SAMPLING = {"temperature": 0.9, "top_k": 6, "top_p": 0.97}
# Every logits processor at once, each reading the history (penalties, a two-token bad word,
# min_tokens) or reshaping the distribution (bias, allowed ids, min-p).
E2E_PROCESSORS = {
    "processors": LogitsProcessing(
        repetition_penalty=1.6,
        frequency_penalty=0.4,
        presence_penalty=0.3,
        logit_bias=((5, 0.8),),
        min_tokens=2,
        stop_token_ids=(0,),
        bad_words=((4, 6),),
        allowed_token_ids=(0, 1, 2, 3, 4, 5, 6),
    ),
    "min_p": 0.03,
}


@pytest.fixture(scope="module")
def small_vocab() -> tuple[Qwen3Target, DFlashDrafter]:
    """Vocabulary 8, a drafter whose first proposal is usually the target's likeliest token
    (so drafts are accepted and rejected often), temperature/top-k/top-p all active."""
    target = random_target(tiny_target_config(E2E_VOCAB, 2, tie_word_embeddings=False), seed=3)
    drafter = random_drafter(target, block_size=4, seed=4)
    make_agreeable(target, drafter, body_scale=0.5)
    return target, drafter


def _exact_three(target: Qwen3Target, extra: dict[str, Any]) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) after E2E_PROMPT under the target alone, by enumeration; `extra`:
    logits processors, applied along each path (t2 sees t1, t3 sees t1 t2)."""
    pairs = [(a, b) for a in range(E2E_VOCAB) for b in range(E2E_VOCAB)]
    ids = torch.tensor([[*E2E_PROMPT, a, b] for a, b in pairs])  # [64, 5]
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.no_grad():
        logits = target(ids, pos).logits[:, -3:]  # [64, 3, vocab]: predicts t1, t2, t3
    sampling = RowSampling(**E2E_SAMPLING, **extra)
    if sampling.processors is not None:
        logits = torch.stack(
            [
                process_block(logits[i], sampling.processors, E2E_PROMPT, (), [a, b])
                for i, (a, b) in enumerate(pairs)
            ]
        )
    probs = speculative.row_probabilities(logits.reshape(-1, E2E_VOCAB), sampling).view(
        len(pairs), 3, -1
    )
    return {
        (a, b, c): float(probs[i, 0, a] * probs[i, 1, b] * probs[i, 2, c])
        for i, (a, b) in enumerate(pairs)
        for c in range(E2E_VOCAB)
    }


def _sample_three(
    target: Qwen3Target,
    drafter: DFlashDrafter | None,
    batches: int,
    rows: int = 400,
    extra: dict[str, Any] | None = None,
) -> dict[tuple[int, ...], int]:
    state = SpecState.create(target, drafter, rows, 16, 4, "cpu", torch.float32)
    counts: dict[tuple[int, ...], int] = {}
    for batch in range(batches):
        sampling = [
            RowSampling(
                **E2E_SAMPLING,
                **(extra or {}),
                generator=torch.Generator().manual_seed(batch * rows + r),
            )
            for r in range(rows)
        ]
        firsts = [
            r.token_ids[0]
            for r in prefill(state, [PrefillRow(r, E2E_PROMPT) for r in range(rows)], sampling)
        ]
        out = {r: [t] for r, t in enumerate(firsts)}
        live = [DecodeRow(r, t, len(E2E_PROMPT), E2E_PROMPT, out[r]) for r, t in enumerate(firsts)]
        while live:
            step = spec_step(state, live, [sampling[row.slot] for row in live])
            nxt = []
            for row, res in zip(live, step, strict=True):
                out[row.slot] += res.token_ids
                if len(out[row.slot]) < 3:
                    position = row.position + len(res.token_ids)
                    nxt.append(
                        DecodeRow(row.slot, res.token_ids[-1], position, E2E_PROMPT, out[row.slot])
                    )
            live = nxt
        for r in range(rows):
            release(state, r)
            key = tuple(out[r][:3])
            counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("extra", [{}, E2E_PROCESSORS], ids=["sampling", "processors"])
@pytest.mark.parametrize("speculate", [True, False], ids=["block4", "plain"])
def test_sampling_matches_the_target_distribution_end_to_end(
    monkeypatch: pytest.MonkeyPatch,
    small_vocab: tuple[Qwen3Target, DFlashDrafter],
    speculate: bool,
    extra: dict[str, Any],
) -> None:
    """4000 samples of the first three generated tokens (512 cells) with and without
    speculation, each against the exact law of the target alone (with every logits
    processor, each position processed on the history it extends)."""
    target, drafter = small_vocab
    accepted: list[int] = []
    real = speculative.accept_sampled

    def spy(probs: torch.Tensor, drafts: list[int], gen: torch.Generator | None) -> tuple[int, int]:
        n, bonus = real(probs, drafts, gen)
        accepted.append(n)
        return n, bonus

    monkeypatch.setattr(speculative, "accept_sampled", spy)
    counts = _sample_three(target, drafter if speculate else None, batches=10, extra=extra)
    assert chi_square_p(counts, _exact_three(target, extra)) > PASS_P
    if speculate:  # the check only means something if drafts are accepted AND rejected
        assert set(accepted) == {0, 1, 2, 3}
        assert 0.1 < sum(n > 0 for n in accepted) / len(accepted) < 0.9


def test_end_to_end_check_fails_for_a_wrong_rule(
    monkeypatch: pytest.MonkeyPatch, small_vocab: tuple[Qwen3Target, DFlashDrafter]
) -> None:
    target, drafter = small_vocab
    monkeypatch.setattr(speculative, "accept_sampled", resample_without_removal)
    counts = _sample_three(target, drafter, batches=10)
    assert chi_square_p(counts, _exact_three(target, {})) < FAIL_P


def test_prefill_in_chunks_equals_prefill_at_once(agreeable: Models) -> None:
    target, drafters = agreeable
    prompt = list(range(5, 17))
    states = [
        SpecState.create(target, drafters[4], 1, MAX_LEN, 4, "cpu", torch.float32) for _ in range(2)
    ]
    whole = prefill(states[0], [PrefillRow(0, prompt)], [GREEDY])
    prefill(states[1], [PrefillRow(0, prompt[:5])], [GREEDY])
    chunked = prefill(states[1], [PrefillRow(0, prompt[5:])], [GREEDY])
    assert whole == chunked and states[1].caches.target.length(0) == len(prompt)
    one, two = states[0].caches.drafter, states[1].caches.drafter
    assert one is not None and two is not None
    for a, b in zip(one.k, two.k, strict=True):
        torch.testing.assert_close(a[:, :, :12], b[:, :, :12], atol=1e-5, rtol=1e-5)


def test_seeded_rows_reproduce_whatever_is_batched_with_them(
    small_vocab: tuple[Qwen3Target, DFlashDrafter],
) -> None:
    target, drafter = small_vocab

    def run(batch: int) -> list[int]:
        state = SpecState.create(target, drafter, batch, 16, 4, "cpu", torch.float32)
        sampling = [RowSampling(1.0, seed=99 + r) for r in range(batch)]
        first = [
            r.token_ids[0]
            for r in prefill(state, [PrefillRow(r, E2E_PROMPT) for r in range(batch)], sampling)
        ]
        rows = [DecodeRow(r, t, len(E2E_PROMPT)) for r, t in enumerate(first)]
        return [first[0], *spec_step(state, rows, sampling)[0].token_ids]

    assert run(1) == run(5)


def test_processors_must_see_the_drafts_before_each_position(
    monkeypatch: pytest.MonkeyPatch, small_vocab: tuple[Qwen3Target, DFlashDrafter]
) -> None:
    """The check above has power: processing every block position on the committed
    history alone (ignoring the drafts before it) is caught."""
    target, drafter = small_vocab

    def drafts_ignored(
        logits: torch.Tensor, proc: LogitsProcessing, prompt: Any, output: Any, drafts: Any
    ) -> torch.Tensor:
        rows = [
            process_block(logits[k : k + 1], proc, prompt, output, ()) for k in range(len(logits))
        ]
        return torch.cat(rows)

    monkeypatch.setattr(speculative, "process_block", drafts_ignored)
    counts = _sample_three(target, drafter, batches=10, extra=E2E_PROCESSORS)
    assert chi_square_p(counts, _exact_three(target, E2E_PROCESSORS)) < FAIL_P


def test_keyed_draws_use_each_sequence_position_once(
    monkeypatch: pytest.MonkeyPatch, small_vocab: tuple[Qwen3Target, DFlashDrafter]
) -> None:
    """A seeded row keys its first token at the prompt's length L and each step's block
    positions after its last token: L, L+1, ... with none skipped or used twice (a key
    used twice would repeat the same randomness; a chunked prefill keys after the chunks)."""
    target, drafter = small_vocab
    seen: list[int] = []
    real = speculative.keyed_token

    def spy(probs: torch.Tensor, seed: int, position: int) -> int:
        token = real(probs, seed, position)
        seen.append(position)
        return token

    monkeypatch.setattr(speculative, "keyed_token", spy)
    monkeypatch.setattr(sampling_module, "keyed_token", spy)
    state = SpecState.create(target, drafter, 1, 32, 4, "cpu", torch.float32)
    row_sampling = RowSampling(1.0, seed=5)
    prompt = E2E_PROMPT
    prefill(state, [PrefillRow(0, prompt[:2])], [GREEDY])
    (first,) = prefill(state, [PrefillRow(0, prompt[2:])], [row_sampling])
    assert seen == [len(prompt)]
    tokens = list(first.token_ids)
    while len(tokens) < 12:
        row = DecodeRow(0, tokens[-1], len(prompt) + len(tokens) - 1)
        seen_before = len(seen)
        (result,) = spec_step(state, [row], [row_sampling])
        # this step keyed the positions of the tokens it committed, from the next one on
        assert seen[seen_before:] == list(
            range(row.position + 1, row.position + 1 + len(result.token_ids))
        )
        tokens.extend(result.token_ids)
    committed = seen[: len(tokens)]
    assert committed == list(range(len(prompt), len(prompt) + len(tokens)))
