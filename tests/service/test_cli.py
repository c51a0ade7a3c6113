"""`dflash-gateway` as a process: flags and env, and the SIGTERM drain; `dflash-serve` plans."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from launcher.local_stack import build_parser, plan
from service.cli import configure_logging, settings_from_args
from service.cli import main as gateway_main
from tests.fixtures.worker import WorkerHandle, free_port
from tests.service.conftest import MODEL, scrape, wait_until
from tests.service.fake_upstream import MODEL as FAKE
from tests.service.fake_upstream import endless_stream, fake_worker
from tests.service.gateway_process import gateway_process


def test_flags_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_GATEWAY_ROUTING", "prefix_affinity")
    monkeypatch.setenv("DFLASH_GATEWAY_PORT", "9100")
    settings = settings_from_args(
        ["--port", "9200", "--worker", "http://a:1", "--worker", "http://b:2"]
    )
    assert (settings.port, settings.routing) == (9200, "prefix_affinity")
    assert settings.workers == ["http://a:1", "http://b:2"]
    assert settings_from_args(["--worker-dns", "w.ns.svc:8000"]).worker_dns == "w.ns.svc:8000"


def test_single_loggers_levels_are_set_over_the_root_s() -> None:
    """--log-levels: one logger at debug under a root at warning (its records reach the
    root's handler), the others as the root."""
    settings = settings_from_args(
        ["--worker", "http://a:1", "--log-level", "warning", "--log-levels", "dflash.x=debug"]
    )
    assert settings.log_levels == {"dflash.x": "debug"}
    try:
        configure_logging(settings.log_level, settings.log_levels)
        assert logging.getLogger("dflash.x").isEnabledFor(logging.DEBUG)
        assert not logging.getLogger("dflash.y").isEnabledFor(logging.INFO)
    finally:
        logging.getLogger("dflash.x").setLevel(logging.NOTSET)


def test_bad_settings_exit_2(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gateway_main([]) == 2  # no worker at all
    assert gateway_main(["--worker", "ftp://x"]) == 2
    assert gateway_main(["--worker-dns", "no-port"]) == 2
    monkeypatch.setenv("DFLASH_GATEWAY_MAX_RETRIES", "-1")
    assert gateway_main(["--worker", "http://a:1"]) == 2


def test_a_capture_dataset_that_cannot_be_written_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before serving, not as a traceback from the app's startup (a user's review)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for uri, said in ((a_file, "a file, not a folder"), (a_file / "x", "cannot write")):
        assert gateway_main(["--worker", "http://a:1", "--capture-uri", str(uri)]) == 2
        err = capsys.readouterr().err
        assert "capture_uri" in err and said in err and "Traceback" not in err, err
    assert gateway_main(["--worker", "http://a:1", "--capture-uri", "ftp://x/y"]) == 2
    assert "unsupported scheme ftp://" in capsys.readouterr().err


def test_a_key_file_without_keys_or_that_does_not_parse_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It would turn auth off (no key), or let its lines in as keys (a misindented tenant
    file): refused at startup, as a reload refuses it (a user's review)."""
    keys = tmp_path / "keys.yaml"
    for text, said in (
        ("tenants: []\n", "no key in it (auth would be off)"),
        ("# rotated weekly\n", "no key in it"),
        ("tenants:\n  - name: a\n    keys: [sk-a]\n   admin: true\n", "nor valid tenant YAML"),
    ):
        keys.write_text(text)
        assert gateway_main(["--worker", "http://a:1", "--api-key-file", str(keys)]) == 2
        assert said in capsys.readouterr().err, text


def test_serve_plans_one_pool_or_two_side_by_side() -> None:
    (one,) = plan(build_parser().parse_args(["--workers", "2", "--no-speculation"]))
    (pool,) = one.pools
    assert (one.port, pool.workers, pool.speculation, pool.name) == (8000, 2, False, "plain")
    dflash, plain = plan(build_parser().parse_args(["--port", "9000", "--compare"]))
    assert (dflash.port, dflash.pools[0].speculation) == (9000, True)
    assert (plain.port, plain.pools[0].speculation) == (9001, False)
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


def test_no_prefix_matching_and_no_secret_in_errors(capsys: pytest.CaptureFixture[str]) -> None:
    secret = "sk-live-0123456789abcdef"
    for argv in (
        ["--api-key", secret, "--worker", "http://a:1"],  # was taken as --api-key-file
        [f"--api-key={secret}", "--worker", "http://a:1"],
        ["--port", secret, "--worker", "http://a:1"],
        ["--worker", "http://a:1", secret],
    ):
        with pytest.raises(SystemExit) as exited:
            gateway_main(argv)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert secret not in err and "error:" in err, err
    with pytest.raises(SystemExit):
        gateway_main(["--api-key-f", "/tmp/x", "--worker", "http://a:1"])  # no abbreviations


def test_invalid_settings_are_named_without_their_values(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DFLASH_GATEWAY_PORT", "sk-live-0123456789abcdef")
    assert gateway_main(["--worker", "http://a:1"]) == 2
    err = capsys.readouterr().err
    assert "port" in err and "sk-live" not in err


def test_drain_refuses_new_requests_with_503_and_cuts_streams_in_band() -> None:
    chat = {"model": FAKE, "messages": [{"role": "user", "content": "hi"}]}
    drain = {"shutdown_delay_s": "0.3", "drain_timeout_s": "1.5"}
    with fake_worker(endless_stream) as fake, gateway_process(fake.url, **drain) as (base, proc):
        lines: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {**chat, "stream": True}
            with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()

        thread = threading.Thread(target=stream)
        thread.start()
        assert started.wait(10)
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: _status(base + "/ready") == 503, timeout=5)
        time.sleep(0.5)  # past the shutdown delay: new requests are refused, not dropped
        refused = httpx.post(base + "/v1/chat/completions", json=chat, timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "draining"
        thread.join(30)
        events = [line for line in lines if line.startswith("data: ")]
        assert len(events) > 10
        assert events[-1] == "data: [DONE]" and '"code":"draining"' in events[-2]
        assert proc.wait(timeout=30) == 0


def test_processes_share_the_port_and_metrics_add_up() -> None:
    chat = {"model": FAKE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with fake_worker() as fake, gateway_process(fake.url, "--processes", "2") as (base, proc):
        for _ in range(30):  # a new connection each: the kernel spreads them
            assert httpx.post(base + "/v1/chat/completions", json=chat, timeout=10).is_success
        for _ in range(4):  # whichever process answers, /metrics counts all of them
            assert scrape(base, "dflash_requests_total", model=FAKE) == 30
        children = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True, text=True
        ).stdout.split()
        assert len(children) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_a_bad_pools_file_is_refused_at_startup_naming_the_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pools = tmp_path / "pools.yaml"
    cases = {
        "- {name: a, model: m, workers: ['http://w:1']}\n"
        "- {name: a, model: m, workers: ['http://w:2']}\n": "duplicate pool names: a",
        "pools:\n- {name: a, model: m, weight: 0, workers: ['http://w:1']}\n": (
            "every pool of model m has weight 0"
        ),
        "- {name: a, model: m, engine: tgi, workers: ['http://w:1']}\n": "pools.0.engine",
        "name: a\n": "unknown top-level key(s) name",
        "routing: fastest\npools:\n- {name: a, model: m, workers: ['http://w:1']}\n": (
            "unknown top-level key(s) routing"
        ),
        "poolz: []\n": "unknown top-level key(s) poolz",
        "pools: {name: a}\n": "expected a list of pools",
        "[unclosed\n": "cannot read pools file",
    }
    for text, named in cases.items():
        pools.write_text(text)
        try:
            code = gateway_main(["--pools", str(pools)])
        except SystemExit as exc:  # argparse's own exit for a file it cannot read
            code = exc.code  # type: ignore[assignment]
        assert code == 2
        err = capsys.readouterr().err
        assert named in err, text
        if "settings" not in err:  # the file's own shape: its path named, not masked
            assert f"pools file {pools}" in err, err
    pools.write_text("- {name: a, model: m, workers: ['http://w:1']}\n")
    assert gateway_main(["--pools", str(pools), "--worker", "http://w:9"]) == 2
    assert "not both" in capsys.readouterr().err
    (spec,) = settings_from_args(["--pools", str(pools)]).pool_specs()
    assert (spec.name, spec.model, spec.workers) == ("a", "m", ["http://w:1"])
