"""`dflash-bench gateway` runs end to end (briefly) and writes the JSON it documents."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.bench import main as bench_main
from loadtest.gateway_bench import PHASES


def test_gateway_bench_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "gateway.json"
    argv = [
        "gateway",
        "--duration",
        "0.4",
        "--warmup",
        "0.1",
        "--streams",
        "8",
        "--events",
        "3",
        "--gap-ms",
        "5",
        "--rps-concurrency",
        "4",
        "--out",
        str(out),
    ]
    assert bench_main(argv) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "gateway"
    assert report["config"]["streams"] == 8
    assert set(report["results"]) == set(PHASES)
    for name, row in report["results"].items():
        for target in ("direct", "gateway"):
            side = row[target]
            assert side["completed"] > 0 and side["errors"] == 0, (name, target, side)
            assert side["latency_ms"]["p50"] <= side["latency_ms"]["p99"]
            assert side["requests_per_s"] > 0
        assert set(row["added_ms"]) == {"p50", "p99"}
    stream = report["results"]["stream"]
    assert stream["gateway"]["event_delay_ms"]["p50"] is not None
    assert set(report["goals"]) >= {"unary", "stream_event", "p50_added_ms_max"}
