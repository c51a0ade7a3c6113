"""Splitting one model's traffic among its pools by weight.

Free functions and one small stateful picker: which pool of a model takes the next request.
Only pools that have a routable worker for the request are offered, so the share of a pool
with none moves to the others at once (no 503 while one pool of the model can serve)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence


def effective_weights(weights: Mapping[str, float]) -> dict[str, float]:
    """Weight-0 pools take traffic only when no weighted pool is offered (a fallback)."""
    weighted = {name: weight for name, weight in weights.items() if weight > 0}
    return weighted or dict.fromkeys(weights, 1.0)


def _unit(key: str, pool: str) -> float:
    """A uniform number in (0, 1) from the key and the pool's name."""
    digest = hashlib.blake2b(f"{pool}\0{key}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 0.5) / 2**64


def by_key(key: str, weights: Mapping[str, float]) -> str:
    """Weighted rendezvous hashing: the same key picks the same pool while the offered pools
    stay the same (a conversation stays on one pool), each pool winning its weight's share
    of keys; a pool leaving moves only its own keys."""
    offered = effective_weights(weights)
    return max(sorted(offered), key=lambda pool: -offered[pool] / math.log(_unit(key, pool)))


class SmoothWeighted:
    """nginx's smooth weighted round robin: over any run of requests each pool's count stays
    within one of its exact share, interleaved rather than in bursts. One per model."""

    def __init__(self) -> None:
        self._current: dict[str, float] = {}

    def pick(self, weights: Mapping[str, float]) -> str:
        offered = effective_weights(weights)
        total = sum(offered.values())
        for name in list(self._current):
            if name not in offered:
                del self._current[name]  # a pool that comes back starts fresh
        best = ""
        for name in sorted(offered):
            self._current[name] = self._current.get(name, 0.0) + offered[name]
            if not best or self._current[name] > self._current[best]:
                best = name
        self._current[best] -= total
        return best


def pool_of(
    model: str,
    offered: Sequence[str],
    weights: Mapping[str, float],
    key: str | None,
    turns: dict[str, SmoothWeighted],
) -> str:
    """The pool for one attempt among `offered` (pools of `model` with a routable worker):
    by the request's key when given, else by smooth round robin."""
    shares = {name: weights[name] for name in offered}
    if len(shares) == 1:
        return offered[0]
    if key is not None:
        return by_key(key, shares)
    turn = turns.get(model)
    if turn is None:
        turn = turns[model] = SmoothWeighted()
    return turn.pick(shares)
