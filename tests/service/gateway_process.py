"""`dflash-gateway` as a real process (its own HTTP protocol, drain and supervisor), for the
tests that need what only the command line sets up."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

import httpx

from tests.fixtures.worker import free_port
from tests.service.conftest import wait_until


def status(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0


@contextlib.contextmanager
def gateway_process(
    worker_url: str, *args: str, **env: str
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """(base URL, process) of a gateway over `worker_url`, ready; killed if still running."""
    port = free_port()
    environ = {**os.environ, "DFLASH_GATEWAY_LOG_LEVEL": "warning"}
    environ.update({f"DFLASH_GATEWAY_{k.upper()}": v for k, v in env.items()})
    argv = [sys.executable, "-m", "service.cli", "--port", str(port), "--worker", worker_url, *args]
    proc = subprocess.Popen(argv, env=environ)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: status(base + "/ready") == 200, timeout=30)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
