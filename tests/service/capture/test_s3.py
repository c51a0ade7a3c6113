"""Capture into S3, against a real S3 API: moto's server (PyPI `moto[server]`), started here,
spoken to by s3fs through botocore, as a gateway in production speaks to a bucket. And a store
that is down: every request is still served, memory stays bounded, drops are counted."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fixtures.worker import WorkerHandle, free_port
from tests.service.conftest import MODEL, running_gateway, wait_until
from wire.capture import read_samples

BUCKET = "dflash-capture"


@contextlib.contextmanager
def aws_env(endpoint: str) -> Iterator[None]:
    """Credentials and an endpoint as a pod gets them (env), for botocore."""
    values = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_MAX_ATTEMPTS": "2",
    }
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def moto_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    server = shutil.which("moto_server", path=str(Path(sys.executable).parent))
    assert server is not None, "moto[server] is a dev dependency (pyproject.toml)"
    log = (tmp_path_factory.mktemp("moto") / "moto.log").open("w")
    process = subprocess.Popen(
        [server, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _answers(endpoint), timeout=60, interval=0.2)
        with aws_env(endpoint):
            import boto3

            boto3.client("s3").create_bucket(Bucket=BUCKET)
            yield endpoint
    finally:
        process.terminate()
        process.wait(10)
        log.close()


def _answers(endpoint: str) -> bool:
    try:
        return httpx.get(endpoint, timeout=1).status_code < 500
    except httpx.HTTPError:
        return False


def ask(base: str, n: int) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"x = {n}"}], "max_tokens": 4}
    return httpx.post(base + "/chat/completions", json=body, timeout=60).status_code


def test_capture_writes_shards_a_reader_loads_from_s3(worker: WorkerHandle, moto_s3: str) -> None:
    uri = f"s3://{BUCKET}/traffic"
    with running_gateway(workers=[worker.base_url], capture_uri=uri, capture_flush_s=0.3) as gw:
        assert [ask(gw.v1, n) for n in range(3)] == [200, 200, 200]
        wait_until(lambda: gw.metric("dflash_capture_samples_total", outcome="written") == 3)
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    names = fs.ls(f"{BUCKET}/traffic", detail=False)
    assert names and all(n.rsplit("/", 1)[1].startswith("capture-") for n in names)
    samples = list(read_samples(uri))
    assert sorted(s.messages[0]["content"] for s in samples if s.messages) == [
        "x = 0",
        "x = 1",
        "x = 2",
    ]


def test_a_store_that_is_down_never_costs_a_request(worker: WorkerHandle) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: every PUT fails
    settings = {
        "capture_uri": f"s3://{BUCKET}/traffic",
        "capture_flush_s": 0.2,
        "capture_queue_bytes": 16 * 1024,
    }
    with aws_env(dead), running_gateway(workers=[worker.base_url], **settings) as gw:
        writer = gw.state.runtime.proxy.capture.writer  # type: ignore[union-attr]
        statuses: list[int] = []
        peak = [0]
        stop = threading.Event()

        def watch_queue() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], writer.queued_bytes)
                time.sleep(0.005)

        watcher = threading.Thread(target=watch_queue)
        watcher.start()
        started = time.monotonic()
        while time.monotonic() - started < 8:
            threads = [
                threading.Thread(target=lambda n=n: statuses.append(ask(gw.v1, n)))
                for n in range(4)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        stop.set()
        watcher.join()
        assert statuses and set(statuses) == {200}
        assert peak[0] <= 16 * 1024

        def dropped() -> float:
            return sum(
                gw.metric("dflash_capture_samples_total", outcome=outcome)
                for outcome in ("store_error", "queue_full")
            )

        wait_until(lambda: dropped() > 0, timeout=30)
        assert gw.metric("dflash_capture_samples_total", outcome="written") == 0
