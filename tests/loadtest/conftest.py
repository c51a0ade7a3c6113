"""Real embedded workers for the load tests: one DFlash, one plain, shared by the session."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.fixtures.worker import WorkerHandle, running_worker

# Small engine: few slots and a short context keep the tiny model's steps cheap on 2 cores.
ENGINE_FLAGS = ("--max-num-seqs", "4", "--max-model-len", "512", "--served-model-name", "tiny")


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
