"""Gateway test fixtures: real `dflash-worker` subprocesses (tiny random checkpoint) and the
real gateway app served by uvicorn on a free loopback port."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from service.api import GatewayState
from service.app import create_app
from service.settings import GatewaySettings
from tests.fixtures.worker import WorkerHandle, free_port

MODEL = "tiny-coder"


def worker_args(checkpoint: Any, *extra: str) -> list[str]:
    """A DFlash worker that verifies every draft each step (vLLM's policy): the gateway's tests
    read its speculation metrics, which the adaptive default would leave empty whenever its
    start-up cost model, measured on a busy machine, chose plain steps."""
    spec = {"method": "dflash", "model": str(checkpoint.drafter_dir), "num_speculative_tokens": 3}
    return [
        "--speculation",
        "fixed",
        str(checkpoint.target_dir),
        "--speculative-config",
        json.dumps(spec),
        "--served-model-name",
        MODEL,
        "--max-model-len",
        "1024",
        "--per-request-spec-decode-metrics",
        "summary",
        *extra,
    ]


@dataclass
class Gateway:
    base_url: str  # http://127.0.0.1:PORT
    app: FastAPI

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    @property
    def state(self) -> GatewayState:
        state: GatewayState = self.app.state.gateway
        return state

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the gateway's /metrics (0 when absent)."""
        return scrape(self.base_url, name, **labels)


def scrape(base_url: str, name: str, **labels: str) -> float:
    return sample(httpx.get(base_url + "/metrics", timeout=5).text, name, **labels)


def sample(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus exposition's samples of `name` with these labels (0: none)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@contextlib.contextmanager
def running_gateway(**overrides: Any) -> Iterator[Gateway]:
    """The gateway app on a free port in a background thread (uvicorn, real HTTP)."""
    overrides.setdefault("health_interval_s", 0.3)
    settings = GatewaySettings(host="127.0.0.1", port=free_port(), log_level="warning", **overrides)
    app = create_app(settings)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("gateway did not start")
        time.sleep(0.02)
    try:
        yield Gateway(f"http://127.0.0.1:{settings.port}", app)
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def wait_until(predicate: Any, timeout: float = 15.0, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)


@contextlib.contextmanager
def worker_on_port(port: int, args: list[str]) -> Iterator[WorkerHandle]:
    """A worker on a chosen port, so a test can kill it and bring it back at the same URL."""
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from tests.fixtures.worker import ROOT, stop_process, wait_healthy

    argv = [sys.executable, "-m", "engine.worker.cli", *args]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with tempfile.NamedTemporaryFile(prefix="dflash-worker-", suffix=".log", delete=False) as log:
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    handle = WorkerHandle(f"http://127.0.0.1:{port}", port, process, Path(log.name))
    try:
        wait_healthy(handle, 120)
        yield handle
    finally:
        stop_process(process)
        handle.log_path.unlink(missing_ok=True)
