"""Local processes as dflash-serve, the benchmarks and the fixtures start and stop them."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.processes import (
    cpu_by_process,
    cpu_seconds,
    free_port,
    healthy,
    process_tree,
    rss_mib,
    stop,
    stop_all,
    wait_healthy,
)


def test_free_ports_are_bindable_and_never_handed_twice() -> None:
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))


def http_server(folder: Path, port: int) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    return subprocess.Popen(
        [*argv, "--directory", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def test_wait_healthy_returns_once_the_url_answers_200(tmp_path: Path) -> None:
    (tmp_path / "health").write_text("ok")
    port = free_port()
    server = http_server(tmp_path, port)
    try:
        took = wait_healthy(f"http://127.0.0.1:{port}/health", server, 30.0)
        assert 0 <= took < 30
        assert healthy(f"http://127.0.0.1:{port}/health")
        assert not healthy(f"http://127.0.0.1:{port}/missing")
    finally:
        stop(server)
    assert server.returncode is not None


def test_a_process_that_dies_fails_the_wait_at_once_with_its_log(tmp_path: Path) -> None:
    log = tmp_path / "log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "print('cannot load the model'); raise SystemExit(3)"],
            stdout=out,
        )
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="cannot load the model") as info:
        wait_healthy(f"http://127.0.0.1:{free_port()}/health", proc, 60.0, name="w", log=log)
    assert "w exited with 3" in str(info.value)
    assert time.monotonic() - start < 30


def test_a_wait_is_bounded() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(TimeoutError, match="not healthy"):
            wait_healthy(f"http://127.0.0.1:{free_port()}/health", proc, 0.5)
    finally:
        stop(proc)


def test_a_process_that_ignores_sigterm_is_killed_after_the_timeout() -> None:
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print(1, flush=True); time.sleep(60)"
    )
    stubborn = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert stubborn.stdout is not None and stubborn.stdout.readline()  # the handler is set
    start = time.monotonic()
    stop_all([stubborn, polite], timeout=1.0)
    assert stubborn.returncode == -9 and polite.returncode == -15
    assert time.monotonic() - start < 15


def test_process_trees_and_their_cpu_and_memory() -> None:
    """The child is started from a thread (as vLLM's engine core is): a child of a thread
    other than the main one belongs to the tree too."""
    code = (
        "import subprocess, sys, threading, time\n"
        "box = []\n"
        "spawn = lambda: box.append(subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(30)']))\n"
        "t = threading.Thread(target=spawn); t.start(); t.join()\n"
        "print(box[0].pid, flush=True); sum(range(3_000_000)); time.sleep(30)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert set(process_tree(parent.pid)) == {parent.pid, child}
        assert cpu_seconds(parent.pid) > 0
        assert rss_mib(parent.pid) > 1
        assert set(cpu_by_process(parent.pid)) == {parent.pid, child}
    finally:
        stop(parent)
        subprocess.run(["kill", str(child)], check=False)
    # an exited process has no tree, no CPU and no memory (no error)
    assert process_tree(parent.pid) == [] and cpu_seconds(parent.pid) == 0.0
    assert rss_mib(parent.pid) == 0.0
