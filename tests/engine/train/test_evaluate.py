"""The eval's greedy oracle (engine/train/evaluate.py): a drafter that always drafts the
target's greedy choice, replayed on the seeded text the engine decoded."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.drafter import DFlashDrafter
from engine.loader import load_drafter, load_target
from engine.model import Qwen3Target
from engine.speculative import DecodeRow, PrefillRow, RowSampling, SpecState, prefill, spec_step
from engine.train.evaluate import greedy_choices, greedy_oracle_steps, sampled_acceptance

ASSETS = Path(__file__).resolve().parents[3] / "engine" / "assets" / "tiny-coder"
PROMPTS = [[5, 17, 42, 99, 7, 31, 8], [64, 12, 9, 200, 41]]


@pytest.fixture(scope="module")
def pair() -> tuple[Qwen3Target, DFlashDrafter]:
    """The bundled target and DFlash drafter, loaded once for the module."""
    target = load_target(ASSETS / "target")
    return target, load_drafter(ASSETS / "dflash", target)


def test_a_draft_stands_while_the_text_follows_the_greedy_choice() -> None:
    # greedy[i] is the choice for output[i + 1]; output[0] came from the prefill.
    output = [10, 11, 12, 13, 14, 15, 16, 17]
    greedy = [11, 12, 99, 14, 15, 16, 17]  # every choice but the one for output[3]
    # block 4 (three drafts): 11, 12 stand, 99 != 13 -> 3 tokens (13 the bonus); then 14, 15,
    # 16 stand -> 4 tokens (17 the bonus).
    assert greedy_oracle_steps(greedy, output, 4) == [3, 4]
    # Without 17 in the text, 16 is the last step's bonus, not a draft.
    assert greedy_oracle_steps(greedy, output[:7], 4) == [3, 3]
    # block 2 (one draft): each step one draft and its bonus, but the miss.
    assert greedy_oracle_steps(greedy, output, 2) == [2, 1, 2, 2]
    assert greedy_oracle_steps(greedy, output[:3], 4) == [2]
    assert greedy_oracle_steps(greedy, [10], 4) == []


@pytest.mark.usefixtures("one_torch_thread")
def test_on_the_bundled_pairs_greedy_text_is_all_oracle_and_sampled_text_is_not(
    pair: tuple[Qwen3Target, DFlashDrafter],
) -> None:
    target, drafter = pair
    at_zero = sampled_acceptance(target, drafter, PROMPTS, 4, 0.0, 24)
    # Temperature 0: the text is the greedy output, so each oracle step commits a full block
    # but each prompt's last (the first 24 tokens: 23 after the prefill's, 5 blocks and 3).
    assert at_zero.greedy_oracle_steps == 2 * 6
    assert at_zero.greedy_oracle >= 3.5
    assert at_zero.mean <= at_zero.greedy_oracle
    hot = sampled_acceptance(target, drafter, PROMPTS, 4, 1.5, 24)
    assert 1.0 <= hot.greedy_oracle < at_zero.greedy_oracle  # samples leave the greedy text
    assert hot.greedy_oracle_steps > at_zero.greedy_oracle_steps
    # A seeded text is the target's keyed samples whatever is drafted: the oracle is the
    # same for another drafter, whose own acceptance differs.
    other = sampled_acceptance(
        target, load_drafter(ASSETS / "dflash2", target), PROMPTS, 4, 1.5, 24
    )
    assert (other.greedy_oracle, other.greedy_oracle_steps) == (
        hot.greedy_oracle,
        hot.greedy_oracle_steps,
    )


@pytest.mark.usefixtures("one_torch_thread")
def test_greedy_choices_are_what_greedy_decoding_commits(
    pair: tuple[Qwen3Target, DFlashDrafter],
) -> None:
    target, drafter = pair
    # At temperature 0 every output token after the first is the greedy choice before it.
    prompt = PROMPTS[0]
    state = SpecState.create(target, drafter, 1, 64, 4, "cpu", target.lm_head.weight.dtype)
    greedy = RowSampling(temperature=0.0)
    out = prefill(state, [PrefillRow(0, prompt)], [greedy])[0].token_ids
    while len(out) < 16:
        row = DecodeRow(slot=0, last_token=out[-1], position=len(prompt) + len(out) - 1)
        out.extend(spec_step(state, [row], [greedy], num_draft=0)[0].token_ids)
    choices = greedy_choices(target, prompt, out)
    assert choices == out[1:]
    steps = greedy_oracle_steps(choices, out, 4)
    assert steps[:-1] == [4] * (len(steps) - 1) and sum(steps) == len(out) - 1
