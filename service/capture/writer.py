"""The capture writer: served requests to dataset shards (wire/capture.py), off the event loop.

The proxy offers each captured request's raw bytes; `offer` never blocks and never raises. A
bounded queue (by bytes) sits between the proxy and one writer thread, which parses, compresses
and writes. When the store is slow or down the queue fills and further samples are dropped and
counted: a request never waits on capture, and memory stays bounded (the queue, plus one shard
being built).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from service.capture.record import RawCapture, Unusable, sample_line
from wire.capture import (
    SHARD_PREFIX,
    SHARD_SUFFIX,
    CaptureDataError,
    compress_shard,
    is_shard,
    open_store,
    redact_uri,
)

log = logging.getLogger("dflash.gateway.capture")

# dflash_capture_samples_total{outcome}: every sample offered ends in one of these.
OUTCOMES = ("written", "queue_full", "too_large", "unusable", "store_error", "shutdown")
# How often a failing store is warned about (each failure is counted).
WARN_EVERY_S = 30.0
# How often the writer looks at its queue (a shard is written at most this late). Looking
# every 10 ms while samples kept coming, so that each look's samples were still in cache,
# read the same (32.9-35.0 against 32.6-35.1 µs of the writer's CPU a sample, real-sized
# answers: loadtest/RESULTS.md, "Capture on real-sized answers").
POLL_S = 0.25
# What a queued sample holds beyond its request and reply bytes (the record object, its
# strings, the queue's slot; 300 bytes measured with tracemalloc, rounded up for the
# allocator): counted against `queue_bytes`, so the bound is on memory, not on payloads.
QUEUED_OVERHEAD_BYTES = 512
# The writer's work between two hand-overs of the GIL to the event loop: a stream waiting to
# open waits no longer than this (a sample takes 5-30 µs, by its size).
YIELD_AFTER_S = 0.0003


@dataclass(frozen=True)
class CaptureConfig:
    uri: str
    shard_bytes: int = 8 * 1024 * 1024  # uncompressed JSON Lines per shard, at most
    flush_s: float = 60.0  # a shard is written at least this often while samples come
    queue_bytes: int = 64 * 1024 * 1024  # what samples waiting for the writer hold, at most
    sample_bytes: int = 4 * 1024 * 1024  # a larger request + reply is not captured
    max_bytes: int | None = 10 * 1024**3  # the dataset's total (compressed); oldest go first
    retention_s: float | None = 7 * 86400.0  # shards older than this are deleted


# (an outcome, "shards" or "cpu_seconds", how many): "cpu_seconds" is the writer thread's own
# CPU time, what capture costs the gateway beyond the event loop's share.
Count = Callable[[str, float], None]


def dataset_problem(uri: str) -> str | None:
    """Why captured samples cannot be written to `uri`, found before serving: a store whose
    extra is not installed, or a local folder that cannot be made or written (a file in its
    place, a parent that is read-only or cannot hold one). A remote store that does not answer
    is not one: its samples wait, then drop, counted (docs/capture.md)."""
    try:
        fs, root = open_store(uri)
    except CaptureDataError as exc:
        return redact_uri(str(exc))
    if "file" not in fs.protocol:
        return None
    if fs.isfile(root):
        return f"{uri}: a file, not a folder"
    try:
        fs.makedirs(root, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as exc:
        return f"{uri}: cannot write captured samples there: {exc.strerror or exc}"
    return None


class CaptureWriter:
    def __init__(self, config: CaptureConfig, count: Count) -> None:
        self.config, self._count = config, count
        self._fs, self._root = open_store(config.uri)
        self._local = "file" in self._fs.protocol
        self._queue: deque[RawCapture] = deque()
        self._queued_bytes = 0
        self._wake = threading.Condition()
        self._stopping = False
        # The shard being built: its lines copied into one buffer, not kept as line objects
        # (orjson's bytes keep a 4 KiB allocation behind a 400-byte line: kept whole, a
        # shard's 8 MiB of lines held 80 MiB while the store was down).
        self._shard = bytearray()
        self._samples = 0
        self._first_at: float | None = None
        self._warned_at = -WARN_EVERY_S
        self._thread = threading.Thread(target=self._run, name="dflash-capture", daemon=True)

    def start(self) -> None:
        if self._local:
            self._fs.makedirs(self._root, exist_ok=True)
        self._thread.start()

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def offer(self, raw: RawCapture) -> None:
        """Queue one request for the writer, or drop it (counted): never blocks."""
        if raw.size > self.config.sample_bytes:
            self._count("too_large", 1)
            return
        size = raw.size + QUEUED_OVERHEAD_BYTES
        with self._wake:
            if self._stopping:
                outcome = "shutdown"
            elif self._queued_bytes + size > self.config.queue_bytes:
                outcome = "queue_full"
            else:
                self._queue.append(raw)
                self._queued_bytes += size
                if self._queued_bytes > self.config.queue_bytes // 2:
                    self._wake.notify()
                return
        self._count(outcome, 1)

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued and stop; what the store has not taken in `timeout_s` is
        left to the daemon thread (and lost at exit)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("capture: the store did not take the last samples in %ss", timeout_s)

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                break
            started = time.thread_time()
            since = time.perf_counter()
            for raw in batch:
                self._add(raw)
                # Hand the GIL to the event loop every fraction of a millisecond: a burst's
                # samples would otherwise hold it for up to a switch interval (5 ms) at a
                # time while streams wait to open. Not after every sample: at thousands of
                # requests a second each hand-over is a thread switch the gateway pays for.
                now = time.perf_counter()
                if now - since >= YIELD_AFTER_S:
                    time.sleep(0)
                    since = time.perf_counter()
            due = self._due()
            if due:
                self._flush()
            if batch or due:  # an idle look does nothing, and counts nothing
                self._count("cpu_seconds", time.thread_time() - started)
        started = time.thread_time()
        last = self._samples
        written = self._flush()
        self._count("cpu_seconds", time.thread_time() - started)
        if written == last:
            log.info("capture: stopped; the last shard (%d samples) written", last)
        else:
            log.warning("capture: stopped; the last %d samples could not be written", last)

    def _next_batch(self) -> list[RawCapture] | None:
        """What is queued, after at most POLL_S; None once stopping with nothing left. The
        writer wakes on its own: a wake-up per request would cost the event loop a thread
        switch per request; `offer` wakes it early only when the queue is half full."""
        with self._wake:
            if not self._queue and not self._stopping:
                self._wake.wait(POLL_S)
            if not self._queue:
                return None if self._stopping else []
            batch = list(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
            return batch

    def _add(self, raw: RawCapture) -> None:
        try:
            line = sample_line(raw)
        except (Unusable, ValueError, TypeError, KeyError) as exc:
            log.debug("capture: request %s not captured: %s", raw.request_id, exc)
            self._count("unusable", 1)
            return
        self._shard += line
        self._shard += b"\n"
        self._samples += 1
        if self._first_at is None:
            self._first_at = time.monotonic()
        if len(self._shard) >= self.config.shard_bytes:
            self._flush()

    def _due(self) -> bool:
        return (
            self._first_at is not None and time.monotonic() - self._first_at >= self.config.flush_s
        )

    def _flush(self) -> int:
        """The shard being built, to the store: the samples written (0 when it failed)."""
        body, samples = self._shard, self._samples
        self._shard, self._samples, self._first_at = bytearray(), 0, None
        if not samples:
            return 0
        try:
            data = compress_shard(body)
            del body  # only the compressed shard is held while the store takes it
            self._write(data)
        except Exception as exc:  # any store failure: the samples are dropped, never retried
            self._count("store_error", samples)
            now = time.monotonic()
            if now - self._warned_at >= WARN_EVERY_S:
                self._warned_at = now
                log.warning(
                    "capture: writing a shard of %d samples to %s failed (%s); they are dropped",
                    samples,
                    self.config.uri,
                    exc,
                )
            return 0
        self._count("written", samples)
        self._count("shards", 1)
        try:
            self._enforce_limits()
        except Exception as exc:
            log.warning("capture: applying the dataset's limits failed: %s", exc)
        return samples

    def _write(self, data: bytes) -> None:
        """One shard, whole or not at all: a local file is renamed into place; an object
        store's PUT is atomic by itself."""
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        name = f"{SHARD_PREFIX}{stamp}-{secrets.token_hex(4)}{SHARD_SUFFIX}"
        path = f"{self._root}/{name}"
        if not self._local:
            self._fs.pipe_file(path, data)
            return
        temporary = f"{self._root}/.{name}.tmp"
        try:
            self._fs.pipe_file(temporary, data)
            self._fs.mv(temporary, path)
        except BaseException:
            if self._fs.exists(temporary):
                self._fs.rm_file(temporary)
            raise

    def _enforce_limits(self) -> None:
        """Retention and the total size: the oldest shards go first."""
        config = self.config
        if config.max_bytes is None and config.retention_s is None:
            return
        entries = [e for e in self._fs.ls(self._root, detail=True) if is_shard(str(e["name"]))]
        entries.sort(key=lambda e: str(e["name"]).rsplit("/", 1)[-1])
        total = sum(int(e.get("size") or 0) for e in entries)
        oldest_kept = time.time() - config.retention_s if config.retention_s is not None else None
        for entry in entries:
            too_old = oldest_kept is not None and shard_time(str(entry["name"])) < oldest_kept
            too_big = config.max_bytes is not None and total > config.max_bytes
            if not (too_old or too_big):
                break
            self._remove(entry)
            total -= int(entry.get("size") or 0)

    def _remove(self, entry: dict[str, Any]) -> None:
        with contextlib.suppress(FileNotFoundError):  # another gateway process was first
            self._fs.rm_file(entry["name"])


def shard_time(path: str) -> float:
    """The UTC time a shard's name begins with (0 when it has none: removed first)."""
    stamp = path.rsplit("/", 1)[-1].removeprefix(SHARD_PREFIX).split("-", 1)[0]
    try:
        return datetime.strptime(stamp, "%Y%m%dT%H%M%S%fZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return 0.0
