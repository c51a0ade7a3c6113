"""Log-probabilities of emitted tokens: log_softmax of the raw logits, rank, top-N."""

from __future__ import annotations

import torch

from engine.logprobs import token_logprobs


def test_values_ranks_and_top_tokens() -> None:
    logits = torch.tensor([[2.0, 1.0, 3.0, 0.0], [0.5, 0.0, 5.0, -1.0]])
    out = token_logprobs(logits, [1, 2], 2)
    logp = torch.log_softmax(logits, dim=-1)
    assert [o.token_id for o in out] == [1, 2]
    assert out[0].logprob == float(logp[0, 1]) and out[1].logprob == float(logp[1, 2])
    assert [o.rank for o in out] == [3, 1]
    assert [t for t, _ in out[0].top] == [2, 0]
    assert out[0].top[0][1] == float(logp[0, 2])
    assert [t for t, _ in out[1].top] == [2, 0]


def test_zero_top_gives_only_the_chosen_token() -> None:
    out = token_logprobs(torch.randn(3, 10), [4, 5, 6], 0)
    assert [o.top for o in out] == [(), (), ()]
    assert all(o.logprob <= 0 and o.rank >= 1 for o in out)


def test_extra_rows_are_ignored() -> None:
    """A verify step has a row per block position; only committed ones are read."""
    logits = torch.randn(5, 10)
    assert token_logprobs(logits, [1, 2], 1) == token_logprobs(logits[:2], [1, 2], 1)
