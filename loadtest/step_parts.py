"""`dflash-bench step --parts`: where DFlash2's own parts spend a drafting step's time.

DFlash2 adds two things to a DFlash drafter (engine/dflash2.py): a grouped causal convolution
around each layer's attention and MLP, and a top-K candidate selector that walks the block's
candidates. Both run inside the step bench's `draft` phase; this module times them there, so
the table can say what share of a step each costs (issue 45: "measure where the convolution
and the selector spend time").

The parts are timed by wrapping the functions that do them, for the length of a bench run:
- conv: GroupedConv.prepare and GroupedConv.finish (the kernel projection and the taps);
- selector: top_candidates (top-K of the logits the drafter computes anyway), the selector's
  edge scores and the greedy walk.
Wall time (perf_counter), as the phases are; on a GPU each wrapped call waits for its kernels
(torch.cuda.synchronize), which slows the step a little but makes the shares honest.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

PARTS = ("conv", "selector")


def _targets() -> dict[str, list[tuple[Any, str]]]:
    from engine import dflash2

    return {
        "conv": [(dflash2.GroupedConv, "prepare"), (dflash2.GroupedConv, "finish")],
        "selector": [
            (dflash2, "top_candidates"),
            (dflash2.CandidateSelector, "scores"),
            (dflash2, "greedy_walk"),
        ],
    }


def _timed(fn: Callable[..., Any], part: str, seconds: dict[str, float], sync: bool) -> Any:
    import torch

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if sync:
                torch.cuda.synchronize()
            seconds[part] += time.perf_counter() - start

    return wrapper


@contextlib.contextmanager
def timing_parts(seconds: dict[str, float], cuda: bool = False) -> Iterator[dict[str, float]]:
    """Accumulate each part's wall seconds into `seconds` (keys PARTS) while inside; the
    wrapped functions are restored on exit."""
    for part in PARTS:
        seconds.setdefault(part, 0.0)
    saved: list[tuple[Any, str, Any]] = []
    try:
        for part, places in _targets().items():
            for owner, name in places:
                original = owner.__dict__[name]
                saved.append((owner, name, original))
                setattr(owner, name, _timed(original, part, seconds, cuda))
        yield seconds
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
