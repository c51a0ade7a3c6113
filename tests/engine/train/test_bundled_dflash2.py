"""The bundled tiny-coder DFlash2 drafter (engine/assets/tiny-coder/dflash2): its layout,
greedy speculative output equal to plain decoding on held-out prompts (the selector's walk
drafts), and `dflash-worker --speculative-config '{"method": "dflash2", ...}'` serving it."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from engine.dflash2 import DFlash2Drafter
from engine.loader import load_drafter, load_target
from engine.model import Qwen3Target
from engine.speculative import RowSampling
from engine.train.corpus import heldout_prompts
from tests.engine.train.test_bundled import assert_lossless_on_heldout
from tests.fixtures.worker import running_worker

ASSETS = Path(__file__).resolve().parents[3] / "engine" / "assets" / "tiny-coder"
DRAFTER = ASSETS / "dflash2"
TRAINED = (ASSETS / "target" / "model.safetensors").exists() and (
    DRAFTER / "model.safetensors"
).exists()
pytestmark = [
    pytest.mark.skipif(not TRAINED, reason="bundled DFlash2 drafter not trained yet"),
    pytest.mark.usefixtures("one_torch_thread"),
]
GREEDY = RowSampling(temperature=0.0)


@pytest.fixture(scope="module")
def models() -> tuple[Qwen3Target, DFlash2Drafter]:
    target = load_target(ASSETS / "target")
    drafter = load_drafter(DRAFTER, target)
    assert isinstance(drafter, DFlash2Drafter)
    return target, drafter


def test_layout_and_size() -> None:
    config = json.loads((DRAFTER / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    assert config["dflash_config"]["selector_top_k"] >= 2
    assert (DRAFTER / "model.safetensors").stat().st_size < 8 * 1024 * 1024


def test_greedy_speculative_equals_plain_on_heldout(
    models: tuple[Qwen3Target, DFlash2Drafter],
) -> None:
    target, drafter = models
    assert_lossless_on_heldout(target, drafter, (8, drafter.block_size))


def test_dflash_worker_serves_it() -> None:
    """The documented command; greedy text equal to a plain worker's, drafts accepted."""
    body = {
        "model": "tiny-coder",
        "prompt": heldout_prompts(1)[0],
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
    }
    spec = json.dumps({"method": "dflash2", "model": str(DRAFTER)})
    texts, accepted = [], 0
    for extra in (["--speculative-config", spec], []):
        args = [str(ASSETS / "target"), "--served-model-name", "tiny-coder", *extra]
        with running_worker(*args) as worker:
            r = httpx.post(f"{worker.base_url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
            if extra:
                spec_metrics = r.json()["metrics"]["speculative_decoding"]
                accepted = int(spec_metrics["num_accepted_draft_tokens"])
    assert texts[0] == texts[1] and texts[0]
    assert accepted > 0
