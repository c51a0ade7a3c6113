"""Temperature / top-k / top-p processing and seeded sampling."""

from __future__ import annotations

import pytest
import torch

from engine import sampling as sampling_module
from engine.sampling import (
    RowSampling,
    greedy,
    keyed_token,
    position_key,
    probabilities,
    row_probabilities,
    sample,
)


def test_temperature_scales_logits_before_softmax() -> None:
    logits = torch.tensor([[1.0, 2.0, 4.0]])
    torch.testing.assert_close(probabilities(logits, 0.5), torch.softmax(logits / 0.5, dim=-1))
    with pytest.raises(ValueError, match="temperature"):
        probabilities(logits, 0.0)


def test_top_k_keeps_the_k_largest() -> None:
    probs = probabilities(torch.tensor([[0.0, 3.0, 1.0, 2.0]]), 1.0, top_k=2)
    assert probs[0, 0] == 0 and probs[0, 2] == 0
    torch.testing.assert_close(probs[0, [1, 3]], torch.softmax(torch.tensor([3.0, 2.0]), 0))


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    probs = probabilities(logits, 1.0, top_p=0.8)  # 0.5 + 0.3 reaches 0.8: keep two
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    probs = probabilities(logits, 1.0, top_p=0.81)  # needs the third token too
    torch.testing.assert_close(probs[0, 2], torch.tensor(0.15 / 0.95))
    assert probabilities(logits, 1.0, top_p=0.3)[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_row_settings_and_greedy() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 0.0, 1.0]])
    assert greedy(logits).tolist() == [1, 0]
    assert RowSampling(0.0).greedy and not RowSampling(0.7).greedy
    row = RowSampling(temperature=2.0, top_k=2)
    torch.testing.assert_close(row_probabilities(logits, row), probabilities(logits, 2.0, 2))


def test_seeded_generators_reproduce_and_frequencies_follow_probs() -> None:
    probs = torch.tensor([0.1, 0.6, 0.3])
    draws = [sample(probs, torch.Generator().manual_seed(s)) for s in range(2000)]
    again = [sample(probs, torch.Generator().manual_seed(s)) for s in range(2000)]
    assert draws == again
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / 2000
    assert torch.allclose(freq, probs, atol=0.04)  # 4 sigma for n = 2000


@pytest.mark.parametrize("top_p", [5e-324, 1e-30, 1e-8])
def test_tiny_top_p_keeps_the_top_token(top_p: float) -> None:
    # The gateway's schemathesis run found a subnormal top_p emptying the nucleus (NaN).
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 3
    probs = probabilities(logits, 0.7, top_p=top_p)
    assert torch.isfinite(probs).all()
    expected = torch.nn.functional.one_hot(logits.argmax(-1), 64).float()
    torch.testing.assert_close(probs, expected)


def test_temperatures_below_the_greedy_threshold_are_greedy() -> None:
    assert RowSampling(temperature=1e-300).greedy
    assert not RowSampling(temperature=1e-4).greedy
    logits = torch.tensor([[10.0, 30.0, 20.0]])
    assert torch.isfinite(probabilities(logits, 1e-4)).all()
    with pytest.raises(ValueError, match="temperature"):
        probabilities(logits, 1e-300)


def test_keyed_draws_are_the_uniforms_place_on_the_cumulative_distribution(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    probs = torch.tensor([0.0, 0.2, 0.8, 0.0])  # filtered tokens on both sides
    for u, token in ((0.0, 1), (0.1999, 1), (0.2, 2), (0.9999, 2), (1.0, 2)):
        # 1.0 stands for a product that rounded up to the total: the last token with mass
        monkeypatch.setattr(sampling_module, "keyed_uniform", lambda seed, pos, u=u: u)
        assert keyed_token(probs, 0, 0) == token, u
    monkeypatch.undo()
    draws = [sampling_module.keyed_uniform(5, position) for position in range(2000)]
    assert all(0.0 <= d < 1.0 for d in draws) and 0.45 < sum(draws) / len(draws) < 0.55


def test_keyed_draws_repeat_per_position_and_follow_probs() -> None:
    probs = torch.tensor([0.1, 0.6, 0.0, 0.3])
    assert keyed_token(probs, 7, 12) == keyed_token(probs, 7, 12)  # the same key, the same token
    # a request's choices (seeds n, n + 1) and neighbouring positions draw unrelated streams
    keys = {position_key(seed, position) for seed in (7, 8) for position in range(64)}
    assert len(keys) == 128
    counts = torch.zeros(4)
    for position in range(6000):
        counts[keyed_token(probs, 11, position)] += 1
    assert counts[2] == 0  # a token the filters removed is never drawn
    assert torch.allclose(counts / counts.sum(), probs, atol=0.02)
    # seeds beyond 64 bits of two's complement (OpenAI's int64 range) still key
    assert keyed_token(probs, -(2**63), 0) in (0, 1, 3)
