"""Local processes, started and stopped the same way everywhere: `dflash-serve`, the
benchmarks (loadtest/harness.py) and the test fixtures. Free loopback ports, health waits
that fail fast when the process dies, SIGTERM-then-SIGKILL stops, and the process trees and
CPU seconds the benchmarks read (psutil)."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import psutil

_HANDED: set[int] = set()


def free_port() -> int:
    """A free loopback port that this process has not handed out before: two servers started
    one after the other must not both get the port the first one has not bound yet."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED:
            _HANDED.add(port)
            return port
    raise RuntimeError("no free loopback port")


def healthy(url: str, timeout: float = 1.0) -> bool:
    """One probe: does `url` answer 200 now?"""
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=timeout).status_code == 200
    return False


def wait_healthy(
    url: str,
    process: subprocess.Popen[bytes] | subprocess.Popen[str],
    timeout: float,
    *,
    name: str = "process",
    log: Path | None = None,
    report_every: float | None = None,
    interval: float = 0.2,
) -> float:
    """Poll `url` until it answers 200 (bounded); the seconds it took. Fails at once when the
    process exits (with the tail of its log); says every `report_every` seconds that it is
    still waiting (a real vLLM takes a minute to load)."""
    start = time.monotonic()
    next_report = start + (report_every or float("inf"))
    while time.monotonic() - start < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{log_tail(log)}")
        if healthy(url, timeout=2.0):
            return time.monotonic() - start
        if time.monotonic() > next_report:
            print(f"  {name}: loading ({time.monotonic() - start:.0f} s) ...", flush=True)
            next_report += report_every or 0.0
        time.sleep(interval)
    raise TimeoutError(f"{name} not healthy at {url} after {timeout:.0f} s\n{log_tail(log)}")


def log_tail(log: Path | None, chars: int = 4000) -> str:
    """The end of a process's log, for an error message ("" without one)."""
    return log.read_text(errors="replace")[-chars:] if log is not None else ""


def stop(process: subprocess.Popen[bytes] | subprocess.Popen[str], timeout: float = 20.0) -> None:
    """SIGTERM (a server drains), then SIGKILL when it outlives `timeout`."""
    stop_all([process], timeout)


def stop_all(
    processes: Sequence[subprocess.Popen[bytes] | subprocess.Popen[str]], timeout: float = 20.0
) -> None:
    """SIGTERM every one first, so they drain side by side within one deadline."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _tree(pid: int) -> list[psutil.Process]:
    """The process and its descendants; none once it has exited. psutil finds children by
    their parent pid, on any platform (reading /proc/PID/task/*/children by hand needed a
    kernel built with CONFIG_PROC_CHILDREN)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:  # exited, or gone while its children were listed
        return []


def process_tree(pid: int) -> list[int]:
    """The process and its descendants (vLLM's engine core, nginx's workers)."""
    return [one.pid for one in _tree(pid)]


def cpu_by_process(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of the process and of each descendant, by pid."""
    found: dict[int, float] = {}
    for one in _tree(pid):
        with contextlib.suppress(psutil.Error):  # a descendant may exit meanwhile
            times = one.cpu_times()
            found[one.pid] = times.user + times.system
    return found


def cpu_seconds(pid: int) -> float:
    """CPU seconds of the process and its descendants."""
    return sum(cpu_by_process(pid).values())


def rss_mib(pid: int) -> float:
    """Resident memory of the process and its descendants, MiB."""
    total = 0
    for one in _tree(pid):
        with contextlib.suppress(psutil.Error):
            total += one.memory_info().rss
    return round(total / 2**20, 1)
