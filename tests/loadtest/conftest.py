"""Real embedded workers for the load tests: one DFlash, one plain, shared by the session."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator

import pytest

from tests.fixtures.worker import WorkerHandle, running_worker

# Small engine: few slots and a short context keep the tiny model's steps cheap on 2 cores.
ENGINE_FLAGS = ("--max-num-seqs", "4", "--max-model-len", "512", "--served-model-name", "tiny")


@pytest.fixture(autouse=True)
def frozen_heap() -> Iterator[None]:
    """The benchmarks run their load generators in this process, and by the time the suite
    reaches them its heap holds millions of objects that every collection walks: the gateway
    bench's run took 31.8 s beside 3 million objects, 5.5 s with them frozen out of collection
    (gc.freeze). What the suite allocated before a test stays out of collection during it."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def dflash_worker(tiny_checkpoint) -> Iterator[WorkerHandle]:  # type: ignore[no-untyped-def]
    spec = {"method": "dflash", "model": str(tiny_checkpoint.drafter_dir)}
    target = str(tiny_checkpoint.target_dir)
    with running_worker(target, "--speculative-config", json.dumps(spec), *ENGINE_FLAGS) as w:
        yield w


@pytest.fixture(scope="session")
def plain_worker(tiny_checkpoint) -> Iterator[WorkerHandle]:  # type: ignore[no-untyped-def]
    with running_worker(str(tiny_checkpoint.target_dir), *ENGINE_FLAGS) as w:
        yield w
