"""`dflash-gateway` as a process: flags and env, and the SIGTERM drain; `dflash-serve` plans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from typing import Any

import httpx
import pytest

from service.cli import main as gateway_main
from service.cli import settings_from_args
from service.local_stack import build_parser, plan
from tests.fixtures.worker import WorkerHandle, free_port
from tests.service.conftest import MODEL, wait_until


def test_flags_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_GATEWAY_ROUTING", "prefix_affinity")
    monkeypatch.setenv("DFLASH_GATEWAY_PORT", "9100")
    settings = settings_from_args(
        ["--port", "9200", "--worker", "http://a:1", "--worker", "http://b:2"]
    )
    assert (settings.port, settings.routing) == (9200, "prefix_affinity")
    assert settings.workers == ["http://a:1", "http://b:2"]
    assert settings_from_args(["--worker-dns", "w.ns.svc:8000"]).worker_dns == "w.ns.svc:8000"


def test_bad_settings_exit_2(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gateway_main([]) == 2  # no worker at all
    assert gateway_main(["--worker", "ftp://x"]) == 2
    assert gateway_main(["--worker-dns", "no-port"]) == 2
    monkeypatch.setenv("DFLASH_GATEWAY_MAX_RETRIES", "-1")
    assert gateway_main(["--worker", "http://a:1"]) == 2


def test_serve_plans_one_pool_or_two_side_by_side() -> None:
    (one,) = plan(build_parser().parse_args(["--workers", "2", "--no-speculation"]))
    assert (one.port, one.workers, one.speculation) == (8000, 2, False)
    dflash, plain = plan(build_parser().parse_args(["--port", "9000", "--compare"]))
    assert (dflash.port, dflash.speculation, plain.port, plain.speculation) == (
        9000,
        True,
        9001,
        False,
    )
    assert plain.base_url == "http://127.0.0.1:9001/v1"


def stream_to_end(base: str, out: dict[str, Any], started: threading.Event) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 150,
        "ignore_eos": True,
    }
    lines: list[str] = []
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            started.set()
            lines.append(line)
    out["last"] = [line for line in lines if line][-1]
    started.set()


def test_sigterm_drains_in_flight_streams(worker: WorkerHandle) -> None:
    port = free_port()
    env = {
        **os.environ,
        "DFLASH_GATEWAY_SHUTDOWN_DELAY_S": "1.5",
        "DFLASH_GATEWAY_LOG_LEVEL": "warning",
    }
    argv = [sys.executable, "-m", "service.cli", "--port", str(port), "--worker", worker.base_url]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _status(base + "/ready") == 200, timeout=30)
        out: dict[str, Any] = {}
        started = threading.Event()
        thread = threading.Thread(target=stream_to_end, args=(base, out, started))
        thread.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: _status(base + "/ready") == 503, timeout=5)  # drain announced
        thread.join(60)
        assert out["last"] == "data: [DONE]"  # the in-flight stream finished
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0
