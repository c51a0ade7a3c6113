"""A short headless Locust run of loadtest/locustfile.py against a real embedded worker.

Locust runs in a subprocess (as a user runs it): importing locust here would monkey-patch
the test process with gevent.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

from loadtest.chat_stream import RequestRecord
from tests.fixtures.worker import WorkerHandle

ROOT = Path(__file__).resolve().parents[2]
METRIC_EVENTS = {"TTFT", "TPOT", "TOKENS_PER_S", "OUTPUT_TOKENS", "ACCEPT_LEN"}


def run_locust(
    host: str, out: Path, *extra: str, seconds: int = 3
) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest/locustfile.py"),
        "--headless", "-u", "2", "-r", "2", "-t", f"{seconds}s", "--host", host,
        "--stop-timeout", "30", "--only-summary", "--csv", str(out / "locust"),
        "--records-file", str(out / "records.jsonl"), "--max-tokens", "12", *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=False)


def test_headless_smoke_run_has_zero_failures_and_reports_custom_events(
    dflash_worker: WorkerHandle, tmp_path: Path
) -> None:
    done = run_locust(dflash_worker.base_url, tmp_path)  # model from GET /v1/models
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    records = [RequestRecord.from_json(line) for line in lines]
    assert records and all(r.error is None for r in records), records[:3]
    assert all(r.output_tokens >= 1 and r.ttft_s is not None for r in records)
    assert all(r.acceptance_length is not None and r.acceptance_length >= 1 for r in records)
    with (tmp_path / "locust_stats.csv").open() as src:
        rows = [row for row in csv.DictReader(src) if row["Name"] != "Aggregated"]
    assert all(row["Failure Count"] == "0" for row in rows)
    kinds = {r.kind for r in records}
    by_event = {(row["Type"], row["Name"]) for row in rows}
    # A request that ends while locust stops is in the records file but may miss the final
    # stats (seen once on a loaded machine): every class in the stats has its records, and
    # every class in the stats has its request and measured values.
    counted = {name.removeprefix("chat ") for kind, name in by_event if kind == "POST"}
    assert counted and counted <= kinds
    for kind in counted:  # per prompt class: the request and its measured values
        assert {"TTFT", "OUTPUT_TOKENS", "ACCEPT_LEN"} <= {t for t, n in by_event if n == kind}
    assert {t for t, _ in by_event} <= METRIC_EVENTS | {"POST"}


def test_failures_are_reported_and_fail_the_run(plain_worker: WorkerHandle, tmp_path: Path) -> None:
    # An unknown model is an OpenAI 404 from the worker: every request must count as failed.
    done = run_locust(plain_worker.base_url, tmp_path, "--model", "no-such-model", seconds=2)
    assert done.returncode == 1
    records = [
        RequestRecord.from_json(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()
    ]
    assert records and all(r.error and "HTTP 404" in r.error for r in records)
