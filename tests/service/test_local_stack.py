"""`dflash-serve --compare`: a DFlash pool and a plain pool side by side, each behind its own
gateway, and Ctrl-C stops all of it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import openai

from tests.fixtures.worker import free_port
from tests.service.conftest import MODEL

URLS = {"dflash": ["http://127.0.0.1:1"]}


def one_pool() -> Any:
    from service.local_stack import LocalGateway, LocalPool

    return LocalGateway(8000, (LocalPool(name="dflash"),))


def test_compare_serves_dflash_and_plain_side_by_side(tiny_checkpoint: Any) -> None:
    port = free_port()
    spec = {"method": "dflash", "model": str(tiny_checkpoint.drafter_dir)}
    argv = [
        sys.executable,
        "-m",
        "service.local_stack",
        "--port",
        str(port),
        "--compare",
        "--compare-port",
        str(free_port()),
        "--log-level",
        "warning",
        f"--worker-arg={tiny_checkpoint.target_dir}",
        f"--worker-arg=--speculative-config={json.dumps(spec)}",
        f"--worker-arg=--served-model-name={MODEL}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        while len(lines) < 2:
            line = proc.stdout.readline()
            assert line, "dflash-serve ended before announcing its pools"
            if "still loading" not in line:
                lines.append(line)
        urls = [line.rsplit(" ", 1)[1].strip() for line in lines]
        assert "dflash (DFlash speculative" in lines[0] and "plain (plain" in lines[1]
        metrics = []
        for url in urls:
            sdk = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
            reply = sdk.completions.create(model=MODEL, prompt="def f():", max_tokens=4)
            metrics.append((reply.model_extra or {})["metrics"])
        assert metrics[0]["speculative_decoding"]["num_spec_steps"] >= 1
        assert "speculative_decoding" not in metrics[1]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_gateway_reuses_worker_connections_for_less_than_the_workers_keep_them(
    monkeypatch: Any,
) -> None:
    from service.local_stack import gateway_settings, worker_env

    monkeypatch.delenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", raising=False)
    monkeypatch.delenv("DFLASH_GATEWAY_UPSTREAM_KEEPALIVE_S", raising=False)
    pool = one_pool()
    env = worker_env()
    assert env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] == "61"
    assert gateway_settings(pool, URLS, "info", env).upstream_keepalive_s == 60
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5")  # the user's value wins
    assert gateway_settings(pool, URLS, "info", worker_env()).upstream_keepalive_s == 4
    monkeypatch.setenv("DFLASH_GATEWAY_UPSTREAM_KEEPALIVE_S", "2")
    assert gateway_settings(pool, URLS, "info", worker_env()).upstream_keepalive_s == 2


def test_dflash_serve_leaves_a_lone_worker_its_own_thread_default(monkeypatch: Any) -> None:
    from service.local_stack import LocalPool, shared_threads, worker_env

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert "OMP_NUM_THREADS" not in worker_env()  # no override of the worker's measured default
    one = LocalPool(name="dflash")
    assert shared_threads(one, 1, 2) == []
    # Several workers share the CPUs: each its share less one for its HTTP side.
    assert shared_threads(one, 2, 8) == ["--threads", "3"]
    assert shared_threads(one, 2, 2) == ["--threads", "1"]
    chosen = LocalPool(name="dflash", workers=2, worker_args=("--threads=2",))
    assert shared_threads(chosen, 2, 8) == []  # the user's choice wins
    vllm = LocalPool(name="d", workers=2, engine="vllm")
    assert shared_threads(vllm, 2, 8) == []  # embedded only
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert shared_threads(one, 2, 8) == []


def test_dflash_serve_api_key_protects_the_gateway() -> None:
    from service.local_stack import build_parser, gateway_settings

    args = build_parser().parse_args(["--api-key", "k1", "--api-key", "k2"])
    pool = one_pool()
    settings = gateway_settings(pool, URLS, "info", {}, args.api_key)
    assert settings.load_api_keys() == ["k1", "k2"]
    assert gateway_settings(pool, URLS, "info", {}, []).load_api_keys() == []
