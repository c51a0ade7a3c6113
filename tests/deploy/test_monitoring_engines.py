"""End to end for the engines that cannot run here: a real Prometheus, with the chart's rules,
scrapes SGLang's and TensorRT-LLM's /metrics as their source writes them (recorded exposition
that advances one second of steady traffic per scrape: tests/fixtures/engine_expositions.py),
each at its own path; every worker panel of the dashboard then shows both engines, with the
values the traffic implies. The vLLM side runs for real in test_monitoring_e2e.py."""

from __future__ import annotations

import re
import shutil
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.chart import DASHBOARD_FILE, ROOT, RULES_FILE
from tests.deploy.promql import (
    dashboard_targets,
    exposition_names,
    metric_names,
    rule_exprs,
    substitute_grafana_vars,
)
from tests.deploy.stack import finite_values, query, running_prometheus
from tests.fixtures import engine_expositions as fx

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="prometheus missing: run `make tools`"
)

ENGINES = {"sglang", "trtllm"}
SGLANG_SOURCE = next(
    (ROOT / ".venv-sglang" / "lib").glob("python3*/site-packages/sglang/srt/observability"),
    None,
)


class _Exposition(BaseHTTPRequestHandler):
    """One engine's /metrics: each scrape is one more second of the same traffic."""

    engine = ""
    ticks = 0

    def do_GET(self) -> None:
        if self.path != fx.PATHS[self.engine]:
            self.send_error(404)
            return
        type(self).ticks += 1
        body = fx.EXPOSITIONS[self.engine](type(self).ticks).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _serve(engine: str) -> ThreadingHTTPServer:
    handler = type(f"{engine}Exposition", (_Exposition,), {"engine": engine, "ticks": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def prometheus() -> Iterator[str]:
    servers = {engine: _serve(engine) for engine in sorted(ENGINES)}
    # Both are the release's workers (job="worker"), each scraped at its engine's path.
    scrapes = [
        {
            "job_name": f"worker-{engine}",
            "metrics_path": fx.PATHS[engine],
            "static_configs": [{"targets": [f"127.0.0.1:{server.server_address[1]}"]}],
            "relabel_configs": [{"target_label": "job", "replacement": "worker"}],
        }
        for engine, server in servers.items()
    ]
    try:
        with running_prometheus({}, RULES_FILE, scrapes) as base:
            # Every panel's series, not the verify-step rate alone: a rate needs two scrapes of
            # each counter it reads, and a panel's ratio is not finite until both of its rates
            # are (SGLang's accepted tokens read three counters); a fresh-clone CI once read
            # SGLang's tokens-from-drafts share before it was.
            deadline = time.monotonic() + 60
            while missing := panels_missing_an_engine(base):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"panels without both engines after 60 s: {missing}")
                time.sleep(0.5)
            yield base
    finally:
        for server in servers.values():
            server.shutdown()
            server.server_close()


def worker_panels() -> list[tuple[str, str]]:
    return [
        (title, expr)
        for title, expr in dashboard_targets(DASHBOARD_FILE)
        if "worker:dflash_" in expr or "engine:dflash_worker_" in expr
    ]


def by_engine(prometheus: str, expr: str) -> dict[str, list[float]]:
    values: dict[str, list[float]] = {}
    for series in query(prometheus, substitute_grafana_vars(expr)):
        values.setdefault(series["metric"]["engine"], []).extend(finite_values([series]))
    return values


def engines_wanted(title: str) -> set[str]:
    # SGLang reports acceptance per draft position only per request (the gateway's view).
    return {"trtllm"} if title == "Acceptance by draft position" else ENGINES


def engines_shown(prometheus: str, expr: str) -> set[str]:
    return {e for e, values in by_engine(prometheus, expr).items() if values}


def panels_missing_an_engine(prometheus: str) -> list[str]:
    """The worker panels whose query does not (yet) show every engine they should."""
    return [
        title
        for title, expr in worker_panels()
        if engines_shown(prometheus, expr) != engines_wanted(title)
    ]


def test_every_worker_panel_shows_both_engines(prometheus: str) -> None:
    panels = worker_panels()
    assert len(panels) >= 10
    for title, expr in panels:
        assert engines_shown(prometheus, expr) == engines_wanted(title), (title, expr)


def test_recorded_values_are_the_traffic(prometheus: str) -> None:
    """Every engine's steady traffic: 10 verify steps/s of 15 drafts, 4 accepted per step."""
    exact = {
        "Draft acceptance rate": 40 / 150,
        "Share of output tokens from drafts": 40 / 51,
    }
    for title, expr in worker_panels():
        if title in exact:
            values = by_engine(prometheus, expr)
            assert values == {e: pytest.approx([exact[title]]) for e in ENGINES}, title
    length = by_engine(
        prometheus,
        "1 + worker:dflash_spec_accepted_tokens:rate5m / worker:dflash_spec_steps:rate5m",
    )
    assert length == {"sglang": pytest.approx([5.0]), "trtllm": pytest.approx([5.0])}
    positions = query(
        prometheus,
        substitute_grafana_vars(
            next(e for t, e in worker_panels() if t == "Acceptance by draft position")
        ),
    )
    share = {int(r["metric"]["position"]): float(r["value"][1]) for r in positions}
    assert share == pytest.approx({0: 1.0, 1: 0.9, 2: 0.8, 3: 0.7, 4: 0.6})
    for name, want in (
        ("worker:dflash_requests_running:sum", fx.RUNNING),
        ("worker:dflash_requests_waiting:sum", fx.WAITING),
        ("worker:dflash_kv_cache_usage:ratio", fx.KV_USAGE),
    ):
        assert by_engine(prometheus, name) == {e: [want] for e in ENGINES}, name
    ttft = by_engine(prometheus, "engine:dflash_worker_time_to_first_token_seconds:p95_5m")
    # Every first token took 50 ms: the quantile lies in the bucket that holds it.
    assert ttft.keys() == ENGINES and all(0.01 < v[0] <= 0.1 for v in ttft.values())


def test_rules_read_only_series_the_engines_export() -> None:
    used: set[str] = set()
    for _, expr in rule_exprs(RULES_FILE):
        used |= metric_names(expr)
    for engine, prefix in (("sglang", "sglang:"), ("trtllm", "trtllm_")):
        names = {n for n in used if n.startswith(prefix)}
        exported = exposition_names(fx.EXPOSITIONS[engine](1))
        assert names and names <= exported, (engine, sorted(names - exported))


def test_sglang_names_are_sglangs_own() -> None:
    """The SGLang names of the fixture are declared in SGLang 0.5.23's own source."""
    if SGLANG_SOURCE is None:
        pytest.skip(".venv-sglang is missing: run `make sglang-env`")
    source = "".join(p.read_text() for p in Path(SGLANG_SOURCE).glob("*.py"))
    declared = set(re.findall(r'name="(sglang:[a-z0-9_]+)"', source))
    for name in exposition_names(fx.sglang_exposition(1)):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert base in declared or base.removesuffix("_total") in declared, name
