"""Logits processors position by position: each block position sees exactly the history it
extends, and each processor follows vLLM's formula (checked against a plain re-statement)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from engine.logits_processors import LogitsProcessing, process_block

VOCAB = 12
PROMPT = [1, 2, 2, 3]
OUTPUT = [4, 5, 4]
DRAFTS = [6, 4, 7]


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(len(DRAFTS) + 1, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _reference(logits: torch.Tensor, proc: LogitsProcessing) -> torch.Tensor:
    """The same processors, restated one position and one token at a time."""
    out = logits.clone().tolist()
    for k, row in enumerate(out):
        history = OUTPUT + DRAFTS[:k]
        for t in range(VOCAB):
            if proc.allowed_token_ids is not None and t not in proc.allowed_token_ids:
                row[t] = -math.inf
        for word in proc.bad_words:
            if len(word) == 1 or history[-(len(word) - 1) :] == list(word[:-1]):
                row[word[-1]] = -math.inf
        if len(history) < proc.min_tokens:
            for t in proc.stop_token_ids:
                row[t] = -math.inf
        for t, bias in proc.logit_bias:
            row[t] += bias
        for t in range(VOCAB):
            if t in PROMPT or t in history:
                p = proc.repetition_penalty
                row[t] = row[t] / p if row[t] > 0 else row[t] * p
            row[t] -= proc.frequency_penalty * history.count(t)
            row[t] -= proc.presence_penalty * (t in history)
    return torch.tensor(out)


CASES = {
    "repetition": LogitsProcessing(repetition_penalty=1.7),
    "repetition below 1": LogitsProcessing(repetition_penalty=0.6),
    "frequency": LogitsProcessing(frequency_penalty=0.9),
    "negative frequency": LogitsProcessing(frequency_penalty=-1.1),
    "presence": LogitsProcessing(presence_penalty=1.3),
    "logit bias": LogitsProcessing(logit_bias=((3, 5.0), (9, -100.0))),
    "min tokens": LogitsProcessing(min_tokens=5, stop_token_ids=(0, 11)),
    "bad words": LogitsProcessing(bad_words=((8,), (4, 7), (5, 4, 6), (6, 9))),
    "allowed": LogitsProcessing(allowed_token_ids=(2, 4, 6)),
    "everything": LogitsProcessing(
        repetition_penalty=1.2,
        frequency_penalty=0.4,
        presence_penalty=0.3,
        logit_bias=((1, 2.0),),
        min_tokens=4,
        stop_token_ids=(0,),
        bad_words=((4, 6),),
        allowed_token_ids=(0, 1, 4, 5, 6, 7),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_processor_matches_its_formula_at_every_position(name: str) -> None:
    proc = CASES[name]
    assert proc.active
    logits = _logits()
    got = process_block(logits, proc, PROMPT, OUTPUT, DRAFTS)
    torch.testing.assert_close(got, _reference(logits, proc))
    assert not torch.equal(got, logits), "the case changes nothing: the test is vacuous"


def test_position_k_sees_only_the_drafts_before_it() -> None:
    """A bad word completed by drafts[:k] bans its last token at k and nowhere before."""
    proc = LogitsProcessing(bad_words=((6, 4, 7, 3),))  # (6, 4, 7) are DRAFTS
    got = process_block(_logits(), proc, PROMPT, OUTPUT, DRAFTS)
    assert got[3, 3] == -math.inf
    assert torch.isfinite(got[:3, 3]).all()
    counts = process_block(
        _logits(), LogitsProcessing(frequency_penalty=1.0), PROMPT, OUTPUT, DRAFTS
    )
    # token 4: twice in OUTPUT, once more from drafts[1] on: the penalty steps at position 2
    torch.testing.assert_close(_logits()[:, 4] - counts[:, 4], torch.tensor([2.0, 2.0, 3.0, 3.0]))


def test_min_tokens_releases_the_stop_ids_once_reached() -> None:
    proc = LogitsProcessing(min_tokens=len(OUTPUT) + 2, stop_token_ids=(0,))
    got = process_block(_logits(), proc, PROMPT, OUTPUT, DRAFTS)
    assert got[:2, 0].eq(-math.inf).all() and torch.isfinite(got[2:, 0]).all()


def test_defaults_are_inactive_and_the_input_is_untouched() -> None:
    assert not LogitsProcessing().active
    assert not LogitsProcessing(min_tokens=3).active  # nothing to hold back
    logits = _logits()
    before = logits.clone()
    process_block(logits, CASES["everything"], PROMPT, OUTPUT, DRAFTS)
    assert torch.equal(logits, before)


def test_a_block_with_no_drafts_is_the_first_token_after_a_prompt() -> None:
    proc = replace(CASES["repetition"])
    got = process_block(_logits()[:1], proc, PROMPT, (), ())
    logits = _logits()[0]
    expected = logits.clone()
    for t in set(PROMPT):
        expected[t] = logits[t] / 1.7 if logits[t] > 0 else logits[t] * 1.7
    torch.testing.assert_close(got[0], expected)


def test_the_block_width_must_match_the_drafts() -> None:
    with pytest.raises(ValueError, match="block positions"):
        process_block(_logits(), CASES["presence"], PROMPT, OUTPUT, DRAFTS[:1])


def test_a_position_with_nothing_left_lets_the_stop_tokens_through() -> None:
    """allowed (4, 7) with the bad word (4, 7) after ...4 and 7 banned alone: position 0
    (history ends with 4) has nothing left; the stop token comes back with its raw logit,
    so the output can end instead of the row's distribution turning NaN."""
    logits = _logits()
    proc = LogitsProcessing(allowed_token_ids=(4, 7), bad_words=((4, 7), (4,)), stop_token_ids=(0,))
    got = process_block(logits, proc, PROMPT, OUTPUT, DRAFTS)
    assert got[0, 0] == logits[0, 0] and torch.isfinite(got).any(dim=-1).all()
    no_stop = process_block(logits, replace(proc, stop_token_ids=()), PROMPT, OUTPUT, DRAFTS)
    torch.testing.assert_close(no_stop[0], logits[0])  # nothing else: the raw logits
