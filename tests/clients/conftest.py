"""Real third-party clients (LangChain, LiteLLM) against the real stack: one `dflash-worker`
(tiny random checkpoint, DFlash on) and one `dflash-gateway` in front of it, shared by every
test in tests/clients and stopped when the package is done."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.stack import running_gateway, wait_ok
from tests.fixtures.worker import ROOT, WorkerHandle, free_port, running_worker, stop_process

# LiteLLM fetches its model price map from GitHub at import; the tests run offline.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

MODEL = "tiny-coder"
# Small, so that a prompt past the context is cheap to send.
MAX_MODEL_LEN = 256


def worker_args(checkpoint: Any) -> list[str]:
    spec = {"method": "dflash", "model": str(checkpoint.drafter_dir), "num_speculative_tokens": 3}
    return [
        str(checkpoint.target_dir),
        "--speculative-config",
        json.dumps(spec),
        "--served-model-name",
        MODEL,
        "--max-model-len",
        str(MAX_MODEL_LEN),
    ]


@pytest.fixture(scope="package")
def worker(tiny_checkpoint: Any) -> Iterator[WorkerHandle]:
    with running_worker(*worker_args(tiny_checkpoint)) as handle:
        yield handle


@pytest.fixture(scope="package")
def gateway(worker: WorkerHandle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The gateway's base URL (no /v1), once /ready."""
    workdir = tmp_path_factory.mktemp("gateway")
    with running_gateway([worker.base_url], workdir, "--health-interval-s", "0.5") as base:
        yield base


@contextlib.contextmanager
def live_gateway(workers: list[str], workdir: Path, *extra: str) -> Iterator[str]:
    """A gateway that is up (/health) but need not be ready: e.g. over a dead worker."""
    port = free_port()
    argv = [sys.executable, "-m", "service.cli", "--host", "127.0.0.1", "--port", str(port)]
    for url in workers:
        argv += ["--worker", url]
    log = workdir / f"gateway-{port}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*argv, *extra], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ok(base + "/health", process, log, timeout=60)
        yield base
    finally:
        stop_process(process)
