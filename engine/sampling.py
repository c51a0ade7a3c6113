"""Token choice: temperature / min-p / top-k / top-p to probabilities, greedy, seeded sampling.

A seeded request's token at sequence position t is drawn with randomness keyed by (seed, t)
alone (`keyed_token`): its text is the same whatever else is batched with it, and whatever
a step verifies (0 drafts or 15: speculative.accept_keyed). An unseeded sampled request
draws from the engine's shared generator, in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.logits_processors import LogitsProcessing

# Below this temperature sampling is greedy (as in vLLM): dividing logits by a smaller one
# overflows float32 to inf and the softmax to NaN.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class RowSampling:
    """Per-row sampling settings; temperature 0 means greedy."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    generator: torch.Generator | None = None  # an unseeded sampled row's draws, in order
    seed: int | None = None  # a seeded row: each position's draw keyed by (seed, position)
    min_p: float = 0.0  # 0 = off
    processors: LogitsProcessing | None = None  # None: the logits are used as they are
    logprobs: int | None = None  # top log-probabilities per emitted token (None: none)
    prompt_logprobs: int | None = None  # the same for each prompt token after the first

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def probabilities(
    logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> Tensor:
    """logits [n, vocab] -> float32 probabilities [n, vocab] after temperature, then min-p
    (tokens less likely than min_p times the most likely one go), then top-k (ties at the
    k-th value are kept), then top-p (smallest prefix of the sorted distribution whose mass
    reaches top_p), renormalised."""
    if temperature < GREEDY_TEMPERATURE:
        raise ValueError(f"probabilities need temperature >= {GREEDY_TEMPERATURE} (else greedy)")
    scores = logits.float() / temperature
    if min_p > 0:
        probs = torch.softmax(scores, dim=-1)
        floor = min_p * probs.max(dim=-1, keepdim=True).values
        scores = scores.masked_fill(probs < floor, float("-inf"))
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # [n, 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        outside = mass_before >= top_p
        # The most likely token always stays: rounding in cumsum can put its mass_before
        # above a tiny top_p, which would leave nothing to sample from.
        outside[..., 0] = False
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def row_probabilities(logits: Tensor, sampling: RowSampling) -> Tensor:
    return probabilities(
        logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p
    )


def greedy(logits: Tensor) -> Tensor:
    """logits [..., vocab] -> argmax token ids [...]."""
    return logits.argmax(dim=-1)


def _on_generator_device(x: Tensor, generator: torch.Generator | None) -> Tensor:
    return x if generator is None else x.to(generator.device)


def sample(probs: Tensor, generator: torch.Generator | None) -> int:
    """One token id from a probability vector [vocab]."""
    probs = _on_generator_device(probs, generator)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def uniform(generator: torch.Generator | None) -> float:
    """One U[0, 1) draw from the row's generator."""
    device = "cpu" if generator is None else generator.device
    return float(torch.rand((), generator=generator, device=device).item())


MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's finaliser: a bijective 64-bit mix (nearby inputs, far-apart outputs)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def position_key(seed: int, position: int) -> int:
    """The generator seed of sequence position `position` of a request seeded `seed`: seeds
    n and n + 1 (a request's choices) and neighbouring positions draw unrelated streams."""
    return _splitmix64(_splitmix64(seed & MASK64) ^ position)


def keyed_uniform(seed: int, position: int) -> float:
    """A U[0, 1) draw of (seed, position) alone: the top 53 bits of one more SplitMix64
    round of the position's key (53: a double's mantissa, so every value is exact)."""
    return (_splitmix64(position_key(seed, position)) >> 11) * 2.0**-53


def keyed_token(probs: Tensor, seed: int, position: int) -> int:
    """probs [vocab] -> one token drawn from them with the randomness of (seed, position):
    where the keyed uniform falls on the cumulative distribution (inverse-CDF sampling, in
    float64), so token i with probability probs[i] exactly, and the same token for the same
    distribution, seed and position. One uniform, not one per vocabulary entry: a fifth of
    the cost of an exponential race over the vocabulary (14 against 63 µs at 4096 tokens)."""
    cdf = probs.double().cumsum(-1)
    point = cdf[-1:] * keyed_uniform(seed, position)
    index = int(torch.searchsorted(cdf, point, right=True).item())
    if index >= probs.shape[-1]:  # the product rounded up to the total: the last token
        index = int(torch.nonzero(probs > 0)[-1].item())  # with mass, never a filtered one
    return index


def draw(probs: Tensor, sampling: RowSampling, position: int) -> int:
    """The token at sequence `position` from probs [vocab]: keyed by the row's seed, else
    from its generator."""
    if sampling.seed is not None:
        return keyed_token(probs, sampling.seed, position)
    return sample(probs, sampling.generator)
