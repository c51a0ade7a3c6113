"""Qwen3 target: logits parity with transformers.Qwen3ForCausalLM (prefill and cached decode)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.loader import load_target, save_target
from engine.model import Qwen3Target
from tests.fixtures.tiny_models import random_target, tiny_target_config

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Qwen3Target, torch.nn.Module]:
    tied = bool(request.param)
    path: Path = tmp_path_factory.mktemp("target")
    save_target(random_target(tiny_target_config(50, 3, tie_word_embeddings=tied), seed=3), path)
    ours = load_target(path)
    theirs = transformers.Qwen3ForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return ours, theirs.eval()


def test_prefill_logits_and_hidden_states_match(pair: tuple[Qwen3Target, torch.nn.Module]) -> None:
    ours, theirs = pair
    ids = torch.randint(0, 50, (2, 11), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(11)[None].expand(2, 11)
    with torch.no_grad():
        out = ours(ids, pos, layer_ids=[0, 1])
        ref = theirs(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)
    expected_hidden = torch.cat([ref.hidden_states[1], ref.hidden_states[2]], dim=-1)
    assert out.hidden is not None
    torch.testing.assert_close(out.hidden, expected_hidden, atol=1e-4, rtol=1e-4)


def test_incremental_decoding_through_slot_cache_matches(
    pair: tuple[Qwen3Target, torch.nn.Module],
) -> None:
    """Rows at different lengths in different slots, padded prefill, then one token at a
    time (and a 3-token chunk) through the cache: every logit equals transformers' full pass."""
    ours, theirs = pair
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 50, (n,), generator=gen) for n in (11, 14)]
    prompt_lens = [4, 7]
    cache = ours.new_cache(num_slots=3, capacity=32, device="cpu", dtype=torch.float32)
    slots = torch.tensor([2, 0])
    with torch.no_grad():
        refs = [theirs(input_ids=s[None]).logits[0] for s in seqs]
        width = max(prompt_lens)
        ids = torch.zeros(2, width, dtype=torch.long)
        valid = torch.zeros(2, width, dtype=torch.bool)
        for r, n in enumerate(prompt_lens):
            ids[r, :n], valid[r, :n] = seqs[r][:n], True
        pos = torch.arange(width)[None].expand(2, width).clone()
        out = ours(ids, pos, valid, cache, slots)
        for r, n in enumerate(prompt_lens):
            torch.testing.assert_close(out.logits[r, :n], refs[r][:n], atol=1e-4, rtol=1e-4)
        start = list(prompt_lens)
        for step in (1, 1, 3, 1):
            ids = torch.stack([s[p : p + step] for s, p in zip(seqs, start, strict=True)])
            pos = torch.stack([torch.arange(p, p + step) for p in start])
            out = ours(ids, pos, None, cache, slots)
            for r, p in enumerate(start):
                torch.testing.assert_close(
                    out.logits[r], refs[r][p : p + step], atol=1e-4, rtol=1e-4
                )
            start = [p + step for p in start]
