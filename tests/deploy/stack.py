"""Real processes for the monitoring end-to-end test: a `dflash-gateway` and a Prometheus
server on 127.0.0.1 free ports, each stopped (SIGTERM, then SIGKILL) on exit."""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.fixtures.worker import ROOT, free_port, stop_process


def wait_ok(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"{process.args!r} exited:\n{log.read_text(errors='replace')[-4000:]}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(
        f"{url} not ready after {timeout}s:\n{log.read_text(errors='replace')[-4000:]}"
    )


@contextlib.contextmanager
def _process(
    argv: list[str],
    ready_path: str,
    port: int,
    workdir: Path,
    timeout: float,
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    log = workdir / f"{Path(argv[0]).name}-{port}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ok(base + ready_path, process, log, timeout)
        yield base
    finally:
        stop_process(process)


@contextlib.contextmanager
def running_gateway(
    workers: list[str], workdir: Path, *extra: str, env: dict[str, str] | None = None
) -> Iterator[str]:
    """`dflash-gateway` over static worker URLs; yields its base URL once /ready."""
    port = free_port()
    argv = [sys.executable, "-m", "service.cli", "--host", "127.0.0.1", "--port", str(port)]
    for url in workers:
        argv += ["--worker", url]
    with _process([*argv, *extra], "/ready", port, workdir, timeout=60, env=env) as base:
        yield base


@contextlib.contextmanager
def running_prometheus(
    jobs: dict[str, list[str]], rule_file: Path, extra: list[dict[str, Any]] | None = None
) -> Iterator[str]:
    """Prometheus scraping `jobs` ({job: [host:port]}) every second, with `rule_file` loaded;
    `extra`: more scrape configs as Prometheus takes them (another path, relabelling)."""
    with tempfile.TemporaryDirectory(prefix="dflash-prom-") as tmp:
        workdir = Path(tmp)
        config = {
            "global": {
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "evaluation_interval": "1s",
            },
            "rule_files": [str(rule_file)],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": targets}]}
                for job, targets in jobs.items()
            ]
            + list(extra or ()),
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        argv = [
            "prometheus",
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]
        with _process(argv, "/-/ready", port, workdir, timeout=60) as base:
            yield base


def query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    """An instant query; raises on a PromQL error."""
    reply = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10.0)
    body = reply.json()
    if body.get("status") != "success":
        raise AssertionError(f"query failed: {expr}\n{body}")
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def finite_values(result: list[dict[str, Any]]) -> list[float]:
    values = [float(series["value"][1]) for series in result]
    return [v for v in values if math.isfinite(v)]
