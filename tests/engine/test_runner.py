"""The ModelRunner on a tiny random checkpoint: what it loads, prefill, one speculative
step, slots coming back, and per-request generators for seeded sampling."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.runner import ModelRunner, torch_dtype
from engine.sequence import SamplingParams, Sequence
from tests.fixtures.tiny_models import TinyCheckpoint


def _runner(ckpt: TinyCheckpoint, k: int | None) -> ModelRunner:
    return ModelRunner(
        EngineConfig(
            target_path=ckpt.target_dir,
            drafter_path=None if k is None else ckpt.drafter_dir,
            num_speculative_tokens=k,
            max_num_seqs=2,
            max_model_len=64,
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


def test_dtype_names() -> None:
    assert torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        torch_dtype("banana")
