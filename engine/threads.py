"""CPU budget of this process and torch thread sizing; a bounded busy-core load for benchmarks.

`available_cpus` = min(CPUs in the affinity mask, the cgroup CPU quota rounded up):
a container limited to 1.5 CPUs on a 64-core host must not start 64 intra-op threads,
which would only preempt each other. `configure_torch_threads` applies it (intra-op) and
keeps inter-op parallelism at one thread: the engine runs one forward at a time.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
from pathlib import Path
from types import TracebackType

CGROUP_ROOT = Path("/sys/fs/cgroup")


def affinity_cpus() -> int:
    """CPUs this process may run on (sched_getaffinity; os.cpu_count where unsupported)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 `cpu.max` ("QUOTA PERIOD" or "max PERIOD") -> CPUs, None = unlimited."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    quota, period = float(parts[0]), float(parts[1])
    return quota / period if quota > 0 and period > 0 else None


def _own_cgroup_paths(proc_cgroup: str) -> list[str]:
    """Cgroup paths from /proc/self/cgroup: the v2 one ("0::/x") and v1 cpu ("N:cpu,...:/x")."""
    paths = []
    for line in proc_cgroup.splitlines():
        fields = line.split(":", 2)
        if len(fields) == 3 and (fields[0] == "0" or "cpu" in fields[1].split(",")):
            paths.append(fields[2])
    return paths


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> float | None:
    """The tightest CPU quota over this process's cgroup and its ancestors (v2 cpu.max or
    v1 cpu.cfs_quota_us / cpu.cfs_period_us), in CPUs; None when there is none."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text(encoding="utf-8")
        except OSError:
            proc_cgroup = ""
    limits: list[float] = []
    for rel in _own_cgroup_paths(proc_cgroup) or ["/"]:
        parts = [p for p in rel.split("/") if p]
        for depth in range(len(parts), -1, -1):
            for base in (root, root / "cpu", root / "cpu,cpuacct"):
                limit = _read_limit(base.joinpath(*parts[:depth]))
                if limit is not None:
                    limits.append(limit)
    return min(limits) if limits else None


def _read_limit(folder: Path) -> float | None:
    try:
        return parse_cpu_max((folder / "cpu.max").read_text(encoding="utf-8"))
    except OSError:
        pass
    try:
        quota = float((folder / "cpu.cfs_quota_us").read_text(encoding="utf-8"))
        period = float((folder / "cpu.cfs_period_us").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def available_cpus() -> int:
    """Whole CPUs this process can use at once: affinity, capped by the cgroup quota."""
    cpus = affinity_cpus()
    limit = cgroup_cpu_limit()
    if limit is not None:
        cpus = min(cpus, max(1, math.ceil(limit)))
    return max(1, cpus)


def serving_threads() -> int:
    """Intra-op threads for a serving process: every available CPU but one, which the HTTP
    side (event loop: tokenizing, formatting and sending each step's tokens) needs while a
    forward pass runs. Intra-op threads on every CPU make it preempt them: on 2 CPUs, HTTP
    client beside it, a plain step went 3.71 -> 2.07 ms and a DFlash step 6.38 -> 4.48 ms
    with one thread instead of two (same run, alternating requests)."""
    return max(1, available_cpus() - 1)


def configure_torch_threads(requested: int | None = None) -> int:
    """Set torch's intra-op threads to `requested` (None: available_cpus()), never more
    than the CPUs available, and inter-op threads to 1. Returns the intra-op count."""
    import torch

    cap = available_cpus()
    threads = cap if requested is None else max(1, min(requested, cap))
    torch.set_num_threads(threads)
    # only settable before the first inter-op work; later calls keep what is set
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    return threads


_SPIN = (
    "import time,sys\nend=time.monotonic()+float(sys.argv[1])\nwhile time.monotonic()<end: pass\n"
)


class BusyCore:
    """A child process spinning on one CPU for at most `seconds` (it ends by itself; the
    context manager ends it earlier). Benchmarks use it to measure under contention."""

    def __init__(self, seconds: float, cpu: int | None = None) -> None:
        self.seconds = seconds
        self.cpu = cpu
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> BusyCore:
        self._proc = subprocess.Popen([sys.executable, "-c", _SPIN, str(self.seconds)])
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if cpus:
            target = cpus[-1] if self.cpu is None else self.cpu
            with contextlib.suppress(OSError):  # unpinned it still takes a core's worth
                os.sched_setaffinity(self._proc.pid, {target})
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
