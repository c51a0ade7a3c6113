"""The ModelRunner on a tiny random checkpoint: what it loads, prefill, one speculative
step, slots coming back, and per-request generators for seeded sampling."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine import runner as runner_module
from engine.config import EngineConfig
from engine.row_speculation import StepPlan
from engine.runner import (
    COLD_GAP_S,
    COLD_STEPS,
    PLAIN_FEEDBACK_EVERY,
    ModelRunner,
    torch_dtype,
)
from engine.sequence import SamplingParams, Sequence
from tests.fixtures.tiny_models import TinyCheckpoint


def _runner(ckpt: TinyCheckpoint, k: int | None, adaptive: bool = False) -> ModelRunner:
    return ModelRunner(
        EngineConfig(
            target_path=ckpt.target_dir,
            drafter_path=None if k is None else ckpt.drafter_dir,
            num_speculative_tokens=k,
            max_num_seqs=2,
            max_model_len=64,
            adaptive=adaptive,
        )
    )


def _seq(slot: int, prompt: list[int], params: SamplingParams) -> Sequence:
    seq = Sequence(
        "r",
        prompt,
        params,
        detokenizer=None,
        eos_token_ids=frozenset(),  # type: ignore[arg-type]
        max_model_len=64,
        arrival_time=0.0,
        num_spec_tokens=None,
    )
    seq.slot = slot
    return seq


def test_block_size_and_plain_without_a_drafter(tiny_checkpoint: TinyCheckpoint) -> None:
    assert _runner(tiny_checkpoint, None).block_size == 1
    spec = _runner(tiny_checkpoint, 3)
    assert spec.block_size == 4 and spec.num_spec_tokens == 3
    assert _runner(tiny_checkpoint, 0).num_spec_tokens is None  # zero drafts: plain


def test_prefill_then_a_step_fill_and_free_the_caches(tiny_checkpoint: TinyCheckpoint) -> None:
    runner = _runner(tiny_checkpoint, 3)
    greedy = SamplingParams(temperature=0.0)
    seq = _seq(0, [3, 4, 5], greedy)
    runner.add(seq)
    (result,) = runner.prefill([seq])
    (first,) = result.token_ids
    assert 0 <= first < runner.vocab_size and runner.kv_cache_usage() > 0
    seq.output_token_ids.append(first)
    (result,) = runner.decode([seq])
    assert 1 <= len(result.token_ids) <= 4 and result.num_drafted == 3
    assert result.num_accepted == len(result.token_ids) - 1
    runner.free_slot(0)
    runner.remove(seq)
    assert runner.kv_cache_usage() == 0


def test_seeded_requests_draw_by_their_own_seed(tiny_checkpoint: TinyCheckpoint) -> None:
    """A seeded request's draws are keyed by its seed (not the runner's generator): the same
    seed gives the same first tokens, other seeds others."""
    runner = _runner(tiny_checkpoint, None)
    seqs = [_seq(i, [3, 4, 5], SamplingParams(temperature=1.0, seed=7)) for i in (0, 1)]
    runner.add(seqs[0])
    assert runner._sampling[id(seqs[0])].seed == 7
    assert runner._sampling[id(seqs[0])].generator is None

    def first_tokens(seed: int) -> list[int]:
        tokens = []
        for offset in range(0, 8, 2):  # two slots: four prefills of two requests
            runner = _runner(tiny_checkpoint, None)
            seqs = [
                _seq(i, [3, 4, 5], SamplingParams(temperature=1.0, seed=seed + offset + i))
                for i in (0, 1)
            ]
            for s in seqs:
                runner.add(s)
            tokens += [r.token_ids[0] for r in runner.prefill(seqs)]
        return tokens

    assert first_tokens(7) == first_tokens(7)
    assert first_tokens(7) != first_tokens(1000)


def test_step_costs_are_not_learnt_from_the_first_steps_after_an_idle_spell(
    tiny_checkpoint: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first COLD_STEPS decode steps after the engine idled run on cold caches: the
    cost feedback skips them, and learns from every step after, until the next idle spell."""
    runner = _runner(tiny_checkpoint, 3, adaptive=True)
    assert runner.policy is not None
    # Every plain step observed too: whether the row drafts follows the start-up calibration,
    # which a busy machine moves (it read a plain step under a parallel suite).
    monkeypatch.setattr(runner_module, "PLAIN_FEEDBACK_EVERY", 1)
    now = [0.0]

    def tick() -> float:
        now[0] += 0.001  # a step: far less than COLD_GAP_S
        return now[0]

    monkeypatch.setattr(runner_module, "time", SimpleNamespace(perf_counter=tick))
    observed: list[float] = []
    monkeypatch.setattr(
        runner.policy, "observe_cost", lambda b, k, seconds, context=None: observed.append(now[0])
    )
    seq = _seq(0, [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=40))
    runner.add(seq)
    seq.output_token_ids += runner.prefill([seq])[0].token_ids

    def decode_steps(n: int) -> int:
        """n decode steps; how many fed the cost feedback."""
        before = len(observed)
        for _ in range(n):
            seq.output_token_ids += runner.decode([seq])[0].token_ids
        return len(observed) - before

    assert decode_steps(COLD_STEPS) == 0  # the first steps ever: cold
    assert decode_steps(2) == 2
    now[0] += 2 * COLD_GAP_S  # idle
    assert decode_steps(COLD_STEPS) == 0
    assert decode_steps(1) == 1


def test_one_plain_step_in_plain_feedback_every_is_learnt_and_every_drafting_one(
    tiny_checkpoint: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch that stays plain feeds the cost feedback one plain step in
    PLAIN_FEEDBACK_EVERY (its host time, on caches the forward has just cleared); a
    drafting step feeds it every time."""
    runner = _runner(tiny_checkpoint, 3, adaptive=True)
    assert runner.policy is not None and runner.planner is not None
    observed: list[int] = []
    monkeypatch.setattr(
        runner.policy, "observe_cost", lambda b, k, seconds, context=None: observed.append(k)
    )
    drafts = [0]
    monkeypatch.setattr(runner.planner, "kept_plan", lambda keys: None)
    monkeypatch.setattr(
        runner.planner, "weigh", lambda keys, *rest: StepPlan(drafts[0], (True,) * len(keys))
    )
    seq = _seq(0, [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=60))
    runner.add(seq)
    seq.output_token_ids += runner.prefill([seq])[0].token_ids

    def decode_steps(n: int) -> list[int]:
        """n decode steps; the k of each that fed the cost feedback."""
        before = len(observed)
        for _ in range(n):
            seq.output_token_ids += runner.decode([seq])[0].token_ids
        return observed[before:]

    decode_steps(COLD_STEPS)  # cold: none learnt (the test above)
    assert decode_steps(3 * PLAIN_FEEDBACK_EVERY) == [0, 0, 0]
    drafts[0] = 2
    assert decode_steps(3) == [2, 2, 2]


def test_dtype_names() -> None:
    assert torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        torch_dtype("banana")


def test_a_plain_step_gives_each_row_its_own_result_in_any_slot_order(
    tiny_checkpoint: TinyCheckpoint,
) -> None:
    """A step the planner keeps plain is one forward over the batch: taken as it is when
    its rows are in slot order, through the grouped path otherwise; either way each row's
    result is its own, in the order the rows were given."""
    got = []
    for order in ((0, 1), (1, 0)):
        runner = _runner(tiny_checkpoint, 3, adaptive=True)
        assert runner.policy is not None
        runner.policy.margin = float("inf")  # no plan is worth drafting
        runner.policy.explore_every = 0
        seqs = [_seq(i, [3, 4, 5 + 2 * i], SamplingParams(temperature=0.0)) for i in (0, 1)]
        for seq in seqs:
            runner.add(seq)
        for seq, result in zip(seqs, runner.prefill(seqs), strict=True):
            seq.output_token_ids += result.token_ids
        for _ in range(3):
            stepped = [seqs[i] for i in order]
            for seq, result in zip(stepped, runner.decode(stepped), strict=True):
                assert result.num_drafted == 0
                seq.output_token_ids += result.token_ids
        assert runner.profile.counts["plain"] == 3 and runner.profile.counts["drafting"] == 0
        got.append([seq.output_token_ids for seq in seqs])
    assert got[0] == got[1]
    assert got[0][0] != got[0][1]  # the rows differ: a mix-up would show
