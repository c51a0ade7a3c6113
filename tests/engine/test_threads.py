"""CPU budget: affinity and cgroup quotas; thread sizing never oversubscribes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from engine import threads


def test_cpu_max_parsing() -> None:
    assert threads.parse_cpu_max("max 100000\n") is None
    assert threads.parse_cpu_max("150000 100000") == 1.5
    assert threads.parse_cpu_max("garbage") is None


def test_cgroup_v2_quota_of_own_group_or_ancestor(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "cpu.max").write_text("250000 100000\n")
    (tmp_path / "a" / "b" / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_cpu_limit(tmp_path, "0::/a/b\n") == 2.5
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # the tightest one wins
    assert threads.cgroup_cpu_limit(tmp_path, "0::/a/b\n") == 0.5


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    group = tmp_path / "cpu" / "job"
    group.mkdir(parents=True)
    (group / "cpu.cfs_quota_us").write_text("300000\n")
    (group / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.cgroup_cpu_limit(tmp_path, "4:cpu,cpuacct:/job\n") == 3.0
    (group / "cpu.cfs_quota_us").write_text("-1\n")  # unlimited
    assert threads.cgroup_cpu_limit(tmp_path, "4:cpu,cpuacct:/job\n") is None


def test_available_cpus_is_capped_by_the_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "affinity_cpus", lambda: 8)
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: 1.5)
    assert threads.available_cpus() == 2
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: None)
    assert threads.available_cpus() == 8


def test_configure_never_exceeds_the_available_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "available_cpus", lambda: 1)
    try:
        assert threads.configure_torch_threads(4) == 1 and torch.get_num_threads() == 1
        assert threads.configure_torch_threads(None) == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("cpus", "expected"), [(1, 1), (2, 1), (8, 7)])
def test_serving_leaves_a_cpu_for_the_http_side(
    monkeypatch: pytest.MonkeyPatch, cpus: int, expected: int
) -> None:
    monkeypatch.setattr(threads, "available_cpus", lambda: cpus)
    assert threads.serving_threads() == expected


def test_busy_core_runs_and_is_ended() -> None:
    with threads.BusyCore(seconds=30.0) as busy:
        proc = busy._proc
        assert proc is not None and proc.poll() is None
        pid = proc.pid
        time.sleep(0.2)
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            assert f.read().split()[2] in {"R", "S"}
    assert proc.poll() is not None  # ended on exit, long before its 30 s
    assert not os.path.exists(f"/proc/{pid}/cmdline") or proc.returncode is not None
