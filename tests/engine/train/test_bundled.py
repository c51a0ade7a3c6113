"""The bundled tiny-coder target + DFlash drafter: they load (transformers and the engine),
generate code, greedy speculative output equals plain decoding on held-out prompts, and a
seeded sampled text does not depend on the drafts each step verifies."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.drafter import DFlashDrafter
from engine.loader import load_drafter, load_target
from engine.model import Qwen3Target
from engine.speculative import DecodeRow, PrefillRow, RowSampling, SpecState, prefill, spec_step
from engine.train.corpus import heldout_prompts

ASSETS = Path(__file__).resolve().parents[3] / "engine" / "assets" / "tiny-coder"
TRAINED = (ASSETS / "target" / "model.safetensors").exists() and (
    ASSETS / "dflash" / "model.safetensors"
).exists()
pytestmark = pytest.mark.skipif(not TRAINED, reason="bundled tiny-coder not trained yet")
GREEDY = RowSampling(temperature=0.0)


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models() -> tuple[Qwen3Target, DFlashDrafter]:
    target = load_target(ASSETS / "target")
    return target, load_drafter(ASSETS / "dflash", target)


def _decode(
    target: Qwen3Target, drafter: DFlashDrafter, block: int, prompt: list[int], n: int
) -> tuple[list[int], list[int]]:
    """Greedy tokens and per-step accepted drafts through the engine's speculative step."""
    state = SpecState.create(target, drafter, 1, 512, block, "cpu", torch.float32)
    out = prefill(state, [PrefillRow(0, prompt)], [GREEDY])[0].token_ids
    accepted: list[int] = []
    while len(out) < n:
        row = DecodeRow(slot=0, last_token=out[-1], position=len(prompt) + len(out) - 1)
        result = spec_step(state, [row], [GREEDY])[0]
        out.extend(result.token_ids)
        accepted.append(result.num_accepted)
    return out[:n], accepted


def test_sizes_and_layout() -> None:
    total = sum(p.stat().st_size for p in ASSETS.rglob("*") if p.is_file())
    assert total <= 24 * 1024 * 1024  # target 11.8 MB, two DFlash 3.5 MB, DFlash2 4.2 MB
    config = json.loads((ASSETS / "dflash" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["mask_token_id"] == 3
    assert set(config["dflash_config"]["target_layer_ids"]) <= set(range(6))


def test_transformers_loads_and_matches_engine(models: tuple[Qwen3Target, DFlashDrafter]) -> None:
    tok = AutoTokenizer.from_pretrained(ASSETS / "target")
    hf = AutoModelForCausalLM.from_pretrained(ASSETS / "target", dtype=torch.float32)
    ids = torch.tensor([tok.encode(heldout_prompts(1)[0], add_special_tokens=False)])
    ours = models[0](ids, torch.arange(ids.shape[1])[None]).logits
    assert torch.allclose(hf(input_ids=ids).logits, ours, atol=1e-3)
    messages = [{"role": "user", "content": "def parse_args(argv):"}]
    chat = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    chat_ids = chat["input_ids"] if not isinstance(chat, torch.Tensor) else chat
    gen = hf.generate(chat_ids, max_new_tokens=32, do_sample=False)
    text = tok.decode(gen[0, chat_ids.shape[1] :], skip_special_tokens=True)
    assert text.strip()  # the chat turn answers with some code


def assert_lossless_on_heldout(
    target: Qwen3Target, drafter: DFlashDrafter, blocks: tuple[int, ...]
) -> None:
    """Greedy speculative decoding at each block size equals plain decoding on held-out
    prompts, and the (trained) drafter beats "always wrong" (1 token a step) clearly."""
    tok = AutoTokenizer.from_pretrained(ASSETS / "target")
    accepted: list[int] = []
    for prompt in heldout_prompts(3):
        ids = tok.encode(prompt, add_special_tokens=False)
        plain, _ = _decode(target, drafter, 1, ids, 40)
        for block in blocks:
            spec, steps = _decode(target, drafter, block, ids, 40)
            assert spec == plain, f"block {block} diverged from plain decoding"
            accepted.extend(steps)
    assert 1 + sum(accepted) / len(accepted) > 1.5


def test_greedy_speculative_equals_plain_on_heldout(
    models: tuple[Qwen3Target, DFlashDrafter],
) -> None:
    target, drafter = models
    assert_lossless_on_heldout(target, drafter, (4, drafter.block_size))


def test_the_portable_drafter_reads_no_last_layer_and_is_lossless() -> None:
    """engine/assets/tiny-coder/dflash-portable: the same recipe on layers [1, 3, 4], so every
    engine can serve it (SGLang captures no last layer); greedy output equals plain decoding."""
    config = json.loads((ASSETS / "dflash-portable" / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [1, 3, 4]
    target = load_target(ASSETS / "target")
    drafter = load_drafter(ASSETS / "dflash-portable", target)
    tok = AutoTokenizer.from_pretrained(ASSETS / "target")
    accepted: list[int] = []
    for prompt in heldout_prompts(2):
        ids = tok.encode(prompt, add_special_tokens=False)
        plain, _ = _decode(target, drafter, 1, ids, 40)
        spec, steps = _decode(target, drafter, drafter.block_size, ids, 40)
        assert spec == plain
        accepted.extend(steps)
    assert 1 + sum(accepted) / len(accepted) > 1.5


def _sampled(
    target: Qwen3Target,
    drafter: DFlashDrafter,
    prompt: list[int],
    sampling: RowSampling,
    plan: list[int],
    n: int,
) -> tuple[list[int], int]:
    """Sampled tokens through the speculative step, step i verifying plan[i % len(plan)]
    drafts; and the drafts accepted."""
    state = SpecState.create(target, drafter, 1, 512, 16, "cpu", torch.float32)
    out = prefill(state, [PrefillRow(0, prompt)], [sampling])[0].token_ids
    accepted, step = 0, 0
    while len(out) < n:
        row = DecodeRow(slot=0, last_token=out[-1], position=len(prompt) + len(out) - 1)
        k = plan[step % len(plan)]
        result = spec_step(state, [row], [sampling], num_draft=k)[0]
        out.extend(result.token_ids)
        accepted += result.num_accepted
        step += 1
    return out[:n], accepted


@pytest.mark.parametrize("temperature", [0.3, 0.7])
def test_a_seeded_text_does_not_depend_on_the_drafts_verified(
    models: tuple[Qwen3Target, DFlashDrafter], temperature: float
) -> None:
    """Seeded sampling on held-out prompts: plans of 0, 1, 3 and 15 drafts a step, and one
    that changes every step, give the same text, and drafting accepts drafts (keyed draws:
    speculative.accept_keyed)."""
    target, drafter = models
    tok = AutoTokenizer.from_pretrained(ASSETS / "target")
    accepted = 0
    for seed, text in enumerate(heldout_prompts(2)):
        prompt = tok.encode(text, add_special_tokens=False)
        sampling = RowSampling(temperature=temperature, seed=seed)
        plain, _ = _sampled(target, drafter, prompt, sampling, [0], 40)
        for plan in ([1], [3], [15], [15, 0, 3, 1, 7]):
            tokens, hits = _sampled(target, drafter, prompt, sampling, plan, 40)
            assert tokens == plain, (seed, plan)
            accepted += hits
    assert accepted > 0
