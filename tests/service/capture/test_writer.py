"""The capture writer: shards whole or absent, rolled by size and time, the dataset's limits,
and every sample counted, written or dropped, without ever blocking the caller."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from service.capture.record import RawCapture
from service.capture.writer import (
    QUEUED_OVERHEAD_BYTES,
    CaptureConfig,
    CaptureWriter,
    dataset_problem,
    shard_time,
)
from tests.service.conftest import wait_until
from wire.capture import read_samples

REPLY = {"choices": [{"index": 0, "message": {"content": "x" * 200}, "finish_reason": "stop"}]}


def raw(n: int, *, reply: bytes | None = None) -> RawCapture:
    request = {"model": "m", "messages": [{"role": "user", "content": f"prompt {n}"}]}
    return RawCapture(
        "/v1/chat/completions",
        json.dumps(request).encode(),
        reply if reply is not None else json.dumps(REPLY).encode(),
        False,
        "m",
        "p",
        None,
        f"req-{n}",
        time.time(),
    )


class Counts:
    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()  # "cpu_seconds" adds up floats
        self.lock = threading.Lock()

    def __call__(self, outcome: str, count: float) -> None:
        with self.lock:
            self.seen[outcome] += count


def writer(tmp_path: Path, **config: Any) -> tuple[CaptureWriter, Counts]:
    counts = Counts()
    return CaptureWriter(CaptureConfig(uri=str(tmp_path / "data"), **config), counts), counts


def test_samples_roll_into_whole_shards_and_close_writes_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    w, counts = writer(tmp_path, shard_bytes=2000, flush_s=3600)
    w.start()
    for n in range(20):
        w.offer(raw(n))
    wait_until(lambda: counts.seen["written"] >= 15)
    w.offer(raw(20))
    with caplog.at_level(logging.INFO, logger="dflash.gateway.capture"):
        w.close()
    assert re.search(r"capture: stopped; the last shard \([1-9]\d* samples\) written", caplog.text)
    names = sorted(p.name for p in (tmp_path / "data").iterdir())
    assert all(name.startswith("capture-") and name.endswith(".jsonl.zst") for name in names)
    assert len(names) >= 5  # ~330 bytes a line, 2000 a shard
    ids = [s.id for s in read_samples(str(tmp_path / "data"))]
    assert sorted(ids) == sorted(f"req-{n}" for n in range(21))
    assert counts.seen["written"] == 21 and counts.seen["shards"] == len(names)
    assert counts.seen["cpu_seconds"] > 0  # the writer thread's own CPU, counted as it works


def test_a_quiet_stream_of_samples_is_written_within_flush_s(tmp_path: Path) -> None:
    w, counts = writer(tmp_path, flush_s=0.2)
    w.start()
    w.offer(raw(1))
    wait_until(lambda: counts.seen["written"] == 1, timeout=5)
    assert [s.id for s in read_samples(str(tmp_path / "data"))] == ["req-1"]
    w.close()


def test_the_total_size_limit_drops_the_oldest_shards(tmp_path: Path) -> None:
    w, counts = writer(tmp_path, shard_bytes=100, flush_s=3600, max_bytes=1500)
    w.start()
    for n in range(30):
        w.offer(raw(n))
        wait_until(lambda n=n: counts.seen["written"] >= n + 1)  # one shard each
    w.close()
    files = list((tmp_path / "data").iterdir())
    assert sum(f.stat().st_size for f in files) <= 1500
    kept = [s.id for s in read_samples(str(tmp_path / "data"))]
    assert kept and kept == [f"req-{n}" for n in range(30 - len(kept), 30)]  # the newest


def test_retention_removes_old_shards(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    old = data / "capture-20200101T000000000000Z-abcd1234.jsonl.gz"
    old.write_bytes(b"x")
    assert shard_time(str(old)) < time.time() - 86400
    w, _ = writer(tmp_path, flush_s=3600, retention_s=86400.0)
    w.start()
    w.offer(raw(1))
    w.close()
    assert not old.exists()
    assert [s.id for s in read_samples(str(data))] == ["req-1"]


def test_a_full_queue_drops_and_counts_without_blocking(tmp_path: Path) -> None:
    w, counts = writer(tmp_path, queue_bytes=2048, flush_s=3600)  # not started: nothing drains
    started = time.perf_counter()
    for n in range(100):
        w.offer(raw(n))
    assert time.perf_counter() - started < 0.5
    assert w.queued_bytes <= 2048
    # The bound is on memory: each sample's bytes and what its record holds beside them.
    assert counts.seen["queue_full"] == 100 - 2048 // (raw(0).size + QUEUED_OVERHEAD_BYTES)


def test_oversized_and_unusable_samples_are_counted(tmp_path: Path) -> None:
    w, counts = writer(tmp_path, sample_bytes=1024, flush_s=3600)
    w.start()
    w.offer(raw(1, reply=b"{" + b" " * 2000 + b"}"))
    w.offer(raw(2, reply=b"not json"))
    w.offer(raw(3))
    w.close()
    assert counts.seen.pop("cpu_seconds") > 0
    assert counts.seen == {"too_large": 1, "unusable": 1, "written": 1, "shards": 1}


class BrokenStore:
    """An object store that is down: every write fails after a while."""

    protocol = ("memory-broken",)

    def __init__(self, delay_s: float) -> None:
        self.delay_s, self.calls = delay_s, 0

    def pipe_file(self, path: str, data: bytes) -> None:
        self.calls += 1
        time.sleep(self.delay_s)
        raise ConnectionError("store unreachable")


def test_a_store_that_is_down_drops_counted_samples_and_memory_stays_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = BrokenStore(delay_s=0.05)
    monkeypatch.setattr("service.capture.writer.open_store", lambda uri: (store, "bucket/x"))
    counts = Counts()
    config = CaptureConfig(uri="s3://bucket/x", shard_bytes=1024, queue_bytes=4096, flush_s=3600)
    w = CaptureWriter(config, counts)
    w.start()
    peak = 0
    for n in range(400):
        w.offer(raw(n))
        peak = max(peak, w.queued_bytes)
    w.close(timeout_s=5)
    assert peak <= 4096
    assert counts.seen["store_error"] > 0 and counts.seen["queue_full"] > 0
    assert counts.seen["written"] == 0
    assert sum(counts.seen[k] for k in ("store_error", "queue_full", "shutdown")) == 400
    assert "store unreachable" in caplog.text  # warned, at most once per 30 s
    assert caplog.text.count("failed (store unreachable)") == 1


def test_a_failed_local_write_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w, counts = writer(tmp_path, flush_s=3600)
    w.start()

    def full_disk(source: str, target: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(w._fs, "mv", full_disk)
    w.offer(raw(1))
    w.close()
    assert list((tmp_path / "data").iterdir()) == []
    assert counts.seen["store_error"] == 1


def test_a_dataset_that_cannot_be_written_is_found_before_serving(tmp_path: Path) -> None:
    """dataset_problem, which dflash-gateway and dflash-serve run before they serve (a clean
    exit 2 naming capture_uri, not a traceback from the writer's start)."""
    folder = tmp_path / "new" / "capture"
    assert dataset_problem(str(folder)) is None and folder.is_dir()  # made, and writable
    assert list(folder.iterdir()) == []  # its probe left nothing
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert dataset_problem(str(a_file)) == f"{a_file}: a file, not a folder"
    under_a_file = dataset_problem(str(a_file / "capture"))
    assert under_a_file is not None and "cannot write captured samples there" in under_a_file
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o500)
    if os.geteuid() != 0:  # root writes anywhere
        assert dataset_problem(str(read_only / "capture")) is not None
    # A remote store is not probed: one that does not answer drops samples, counted.
    assert dataset_problem("s3://bucket/prefix") is None
