"""WorkerState on its own: loading (and failing to), draining, the engine's settings."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from engine.worker.settings import load_settings
from engine.worker.state import WorkerState, engine_config
from tests.fixtures.tiny_models import TinyCheckpoint


@pytest.mark.anyio
async def test_a_load_failure_is_recorded_and_reported(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path
) -> None:
    broken = tmp_path / "target"
    shutil.copytree(tiny_checkpoint.target_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    state = WorkerState(load_settings(model=str(broken)), None)
    fatal: list[bool] = []
    state.on_fatal = lambda: fatal.append(True)
    state.on_ready = lambda: fatal.append(False)
    await state.load()
    assert fatal == [True] and not state.ready
    assert state.load_error is not None and state.load_error.startswith("CheckpointError:")


@pytest.mark.anyio
async def test_load_then_drain_shuts_the_engine_down(tiny_checkpoint: TinyCheckpoint) -> None:
    settings = load_settings(model=str(tiny_checkpoint.target_dir), max_model_len=128)
    state = WorkerState(settings, None)
    assert state.metrics is not None and not state.ready
    started: list[bool] = []  # the hook runs once the engine is up, before ready
    state.on_ready = lambda: started.append(state.engine is not None and not state.ready)
    await state.load()
    assert started == [True]
    assert state.ready and state.engine is not None and state.load_error is None
    state.begin_drain()
    assert state.draining
    load = asyncio.get_running_loop().create_task(asyncio.sleep(0))
    await load
    await state.close(load)
    assert not state.ready


def test_engine_config_carries_the_drafter_and_limits(tiny_checkpoint: TinyCheckpoint) -> None:
    spec = {
        "method": "dflash",
        "model": str(tiny_checkpoint.drafter_dir),
        "num_speculative_tokens": 3,
    }
    settings = load_settings(
        model=str(tiny_checkpoint.target_dir), speculative_config=spec, max_num_seqs=3
    )
    config = engine_config(settings)
    assert config.drafter_path == tiny_checkpoint.drafter_dir
    assert (config.num_speculative_tokens, config.max_num_seqs) == (3, 3)
    plain = engine_config(load_settings(model=str(tiny_checkpoint.target_dir)))
    assert plain.drafter_path is None and plain.num_speculative_tokens is None
