"""`dflash-bench gateway` runs end to end (briefly) and writes the JSON it documents."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


def test_peers_bench_runs_every_installed_peer_and_says_why_others_are_missing(
    tmp_path: Path,
) -> None:
    out = tmp_path / "peers.json"
    argv = ["gateway", "--peers", "--litellm", "--duration", "0.3", "--warmup", "0.1"]
    argv += ["--rounds", "1"]
    argv += ["--concurrency", "4", "--events", "3", "--burst", "5", "--out", str(out)]
    assert bench_main(argv) == 0
    report = json.loads(out.read_text())
    names = [row["proxy"] for row in report["results"]]
    assert names[0] == "dflash-gateway"
    assert set(report["versions"]) == set(names)  # each as the peer itself reports it
    assert "unknown" not in report["versions"].values(), report["versions"]
    for peer in ("nginx", "vllm-router", "litellm"):
        assert (peer in names) != (peer in report["missing"])  # run, or said why not
    for row in report["results"]:
        assert row["unary_errors"] == row["stream_errors"] == row["burst_errors"] == 0, row
        assert row["unary_cpu_us_per_request"] > 0 and row["streams_per_s"] > 0
        assert row["burst_added_ttft_ms"]["p99"] is not None
        # the first burst after the warm-up (upstream connections opened) is kept apart
        assert row["first_burst_added_ttft_ms"]["p99"] is not None


def test_peers_bench_limits_runs_the_gateway_with_keys_and_limits(tmp_path: Path) -> None:
    """--limits: the same load through the gateway with the load's key, then with a tenant's
    limits counted in the process and in a Redis the bench starts (none reached: no error),
    reached over TCP and TLS by the gateway's client and by redis-py's. --capture in the same
    run (one set of peers started once): the gateway capturing into a folder, and into an S3
    store that is down the whole run; both serve every request, the first writes, the second
    counts its drops (each reply a passage of prose, as `--reply-chars` sends)."""
    out = tmp_path / "limits.json"
    argv = ["gateway", "--peers", "--limits", "--capture", "--duration", "0.3", "--warmup", "0.1"]
    argv += ["--rounds", "1", "--concurrency", "4", "--events", "3", "--burst", "5"]
    argv += ["--reply-chars", "400"]  # a new passage of prose in each reply, as capture sees
    assert bench_main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["reply_chars"] == 400
    rows = {row["proxy"]: row for row in report["results"]}
    limited = ("dflash-gateway (keys)", "dflash-gateway (limits)", "dflash-gateway (limits, redis)")
    limited += tuple(
        f"dflash-gateway (limits, {way})" for way in ("rediss", "redis-py", "redis-py, rediss")
    )
    assert set(limited) <= set(rows), sorted(rows)
    for name in limited:
        row = rows[name]
        assert row["unary_errors"] == row["stream_errors"] == row["burst_errors"] == 0, row
        assert row["unary_cpu_us_per_request"] > 0
        assert row["store_errors"] == 0 or "limits" not in name, row  # checked, not served open
    for name in ("dflash-gateway (capture)", "dflash-gateway (capture, store down)"):
        row = rows[name]
        assert row["unary_errors"] == row["stream_errors"] == row["burst_errors"] == 0, row
        # Read after each round: whether memory plateaus while the store is down.
        assert len(row["rss_mb_by_round"]) == 1 and row["rss_mb"] > 0  # --rounds 1
    # Every request a capturing gateway served is counted once, as written or as dropped.
    down = report["capture"]["dflash-gateway (capture, store down)"]
    assert down.get("written", 0) == 0
    assert sum(down.values()) == rows["dflash-gateway (capture, store down)"]["requests_served"]
    captured = report["capture"]["dflash-gateway (capture)"]
    assert captured["written"] == rows["dflash-gateway (capture)"]["requests_served"] > 0
    # Capture by tenant, in one process: the captured tenant's requests, all written, and
    # none of the other two tenants' (they are counted on the same process).
    writer_us = report["capture_writer_us_per_sample"]
    assert writer_us["dflash-gateway (tenants, captured)"] > 0  # the writer thread's CPU
    assert writer_us["dflash-gateway (capture, store down)"] is None  # nothing written
    by_tenant = report["capture"]["dflash-gateway (tenants, captured)"]
    assert by_tenant["written"] == sum(by_tenant.values())
    assert by_tenant["written"] == rows["dflash-gateway (tenants, captured)"]["requests_served"]
    for name in (
        "dflash-gateway (tenants, not captured)",
        "dflash-gateway (tenants, not captured, A/A)",
    ):
        assert rows[name]["requests_served"] > 0 and rows[name]["unary_errors"] == 0
    costs = report["costs"]
    assert costs["capture"]["goal"] == 1.10
    ratios = {"unary_cpu_us_per_request", "stream_cpu_us_per_stream"}
    assert set(costs["capture"]) == ratios | {"goal", "met", "by_the_writer_alone"}
    # The writer's CPU read around each of the three tenants' phases, the captured one's
    # beside the gateway's: capture's cost as the writer alone reads it.
    on = rows["dflash-gateway (tenants, captured)"]
    assert on["unary_writer_cpu_us_per_request"] > 0 and on["stream_writer_cpu_us_per_stream"] > 0
    assert set(costs["capture"]["by_the_writer_alone"]) == ratios
    assert all(x > 1 for x in costs["capture"]["by_the_writer_alone"].values())
    assert set(costs["capture, another process"]) == ratios  # read, with no goal
    assert set(costs["capture's A/A"]) == ratios | {"by_the_writer_alone"}  # its control
    # The goal's base is both uncaptured tenants' mean; against the first alone, kept beside.
    on_one, aa = costs["capture, against one tenant"], costs["capture's A/A"]
    for key in ratios:
        both = costs["capture"][key]
        assert both == pytest.approx(on_one[key] / ((1 + aa[key]) / 2), abs=0.002)


def test_scaling_bench_runs_each_process_count(tmp_path: Path) -> None:
    out = tmp_path / "scaling.json"
    # 1 is measured although not asked for: the baseline of the ratios. 16 clients: the
    # kernel puts all of them on one of two processes with probability 2 / 2**16.
    argv = ["gateway", "--scaling", "--processes", "2", "--duration", "0.5", "--warmup", "0.1"]
    argv += ["--rounds", "1", "--concurrency", "16", "--out", str(out)]
    assert bench_main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["processes"] for r in rows] == [1, 2]
    for r in rows:
        assert r["errors"] == 0, r
        assert r["requests_per_s"] > 0 and r["gateway_cores_busy"] > 0
        assert r["cpu_us_per_request"] > 0 and r["efficiency"] > 0
    assert rows[0]["process_cpu_shares"] == [1.0]
    # both processes of the second gateway served requests, not just health checks
    shares = rows[1]["process_cpu_shares"]
    assert len(shares) == 2 and min(shares) > 0.02, shares


def test_abbreviated_bench_flags_are_refused() -> None:
    with pytest.raises(SystemExit):  # `--scal` must not run the plain bench instead
        bench_main(["gateway", "--scal"])


def test_timed_slices_run_without_the_collector() -> None:
    import asyncio
    import gc

    from loadtest.gateway_bench import without_collector

    async def slice_() -> bool:
        return gc.isenabled()

    assert gc.isenabled()
    assert asyncio.run(without_collector(slice_())) is False
    assert gc.isenabled()
