"""The engine core's settings: what to load and how big to make it (no HTTP, no CLI)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EngineConfig:
    target_path: Path
    drafter_path: Path | None = None  # None = plain decoding
    num_speculative_tokens: int | None = None  # None = the drafter's block_size - 1
    max_num_seqs: int = 8
    max_model_len: int = 2048
    max_waiting: int = 64  # waiting-queue bound; beyond it: QueueFull
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    # False: every step verifies num_speculative_tokens drafts (vLLM's behaviour).
    # True: each step verifies the k in [0, num_speculative_tokens] that a cost model
    # measured at start-up and the live acceptance say gives the most tokens per second
    # (engine/adaptive.py); k = 0 is plain decoding, so it is never slower than plain.
    adaptive: bool = False
    # True: the drafter's matmuls in int8 (engine/layers.py FusedWeight `int8`; CPU with
    # fbgemm, else a ValueError). Drafts only propose, so outputs stay the target's exactly;
    # acceptance may move slightly. The target is never quantized.
    drafter_int8: bool = False


def block_size_for(num_speculative_tokens: int | None, drafter_block: int | None) -> int:
    """Tokens verified per step: num_speculative_tokens + 1, bounded by the drafter's
    block; 1 (plain decoding) without a drafter."""
    k = num_speculative_tokens
    if drafter_block is None:
        if k:
            raise ValueError("num_speculative_tokens needs a drafter")
        return 1
    if k is None:
        return drafter_block
    if not 0 <= k < drafter_block:
        raise ValueError(
            f"num_speculative_tokens must be in [0, {drafter_block - 1}] for a drafter "
            f"with block_size {drafter_block}, got {k}"
        )
    return k + 1
