"""`dflash-bench gateway --scaling`: requests/s of one gateway started with `--processes N`
(SO_REUSEPORT, the kernel spreading connections), for each N, in interleaved rounds.

Nothing is pinned: the gateway's processes, the stub upstream and the load generator share
the machine's cores, so the total requests/s stops growing once the cores are busy. What
says whether the gateway itself scales is its own CPU: the cores its processes kept busy and
the requests served per busy gateway core (flat = each added process adds a core's worth;
falling = the processes get in each other's way). Per N: requests/s and its ratio to one
process, gateway cores busy, CPU µs per request, requests/s per gateway core, errors.
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.gateway_bench import (
    Sample,
    aligned,
    body,
    closed_loop,
    wait_healthy,
    without_collector,
    write_report,
)
from loadtest.gateway_peers import ROOT, cpu_seconds, fresh_port, stop, stub_process


@dataclass
class Totals:
    completed: int = 0
    errors: int = 0
    elapsed_s: float = 0.0
    cpu_s: float = 0.0


def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,2: {text!r}")
    return values


def start_gateway(processes: int, upstream: int) -> tuple[subprocess.Popen[bytes], int]:
    port = fresh_port()
    argv = [sys.executable, "-m", "service.cli", "--port", str(port)]
    argv += ["--worker", f"http://127.0.0.1:{upstream}", "--log-level", "warning"]
    argv += ["--processes", str(processes)]
    # The stub shares the cores with the load generator: a slow /health must not mark it
    # down (as in the peers bench).
    env = {**os.environ, "DFLASH_GATEWAY_API_KEYS": "", "DFLASH_GATEWAY_HEALTH_TIMEOUT_S": "5"}
    env.pop("DFLASH_GATEWAY_API_KEY_FILE", None)
    process = subprocess.Popen(argv, env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    return process, port


async def measure(port: int, pid: int, args: argparse.Namespace) -> tuple[Sample, float]:
    """A closed loop of unary requests; the sample and the gateway's CPU seconds over it."""
    await closed_loop(port, body(False), 8, args.warmup, False)
    before = cpu_seconds(pid)
    loop = closed_loop(port, body(False), args.concurrency, args.duration, False)
    sample = await without_collector(loop)
    return sample, cpu_seconds(pid) - before


def one_slice(processes: int, upstream: int, args: argparse.Namespace, into: Totals) -> None:
    """A fresh gateway with this many processes, measured, stopped."""
    process, port = start_gateway(processes, upstream)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/ready", process, 60)
        sample, cpu_s = asyncio.run(measure(port, process.pid, args))
    finally:
        stop(process)
    into.completed += sample.completed
    into.errors += sample.errors
    into.elapsed_s += sample.elapsed_s
    into.cpu_s += cpu_s


def row(processes: int, totals: Totals, one: Totals) -> dict[str, Any]:
    rate = totals.completed / totals.elapsed_s if totals.elapsed_s else 0.0
    one_rate = one.completed / one.elapsed_s if one.elapsed_s else 0.0
    cores = totals.cpu_s / totals.elapsed_s if totals.elapsed_s else 0.0
    return {
        "processes": processes,
        "requests_per_s": round(rate, 1),
        "vs_one_process": round(rate / one_rate, 2) if one_rate else None,
        "gateway_cores_busy": round(cores, 2),
        "cpu_us_per_request": round(totals.cpu_s / totals.completed * 1e6, 1)
        if totals.completed
        else None,
        "requests_per_s_per_gateway_core": round(rate / cores, 1) if cores else None,
        "errors": totals.errors,
    }


def table(rows: list[dict[str, Any]]) -> str:
    keys = (
        "processes",
        "requests_per_s",
        "vs_one_process",
        "gateway_cores_busy",
        "cpu_us_per_request",
        "requests_per_s_per_gateway_core",
        "errors",
    )
    head = ("processes", "req/s", "x 1 process", "gateway cores", "CPU µs/req", "req/s/core")
    lines: list[tuple[str, ...]] = [(*head, "errors")]
    lines += [tuple(str(r[k]) for k in keys) for r in rows]
    return aligned(lines, " | ")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflash-bench gateway --scaling",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
    )
    p.add_argument("--scaling", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--processes", type=int_list, default=[1, 2], help="e.g. 1,2,4 (1 is always measured)"
    )
    p.add_argument("--duration", type=float, default=6.0, help="seconds per slice")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=2, help="interleaved slices per N")
    p.add_argument("--concurrency", type=int, default=64, help="clients of the closed loop")
    p.add_argument("--out", type=Path, default=Path("bench-results/gateway-scaling.json"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    counts = sorted({1, *args.processes})  # one process is the baseline of the ratios
    totals = {n: Totals() for n in counts}
    with stub_process(1, None) as upstream:  # unary requests only; nothing pinned
        for _ in range(args.rounds):
            for n in counts:
                one_slice(n, upstream, args, totals[n])
    rows = [row(n, totals[n], totals[1]) for n in counts]
    print(table(rows))
    print(f"({os.cpu_count()} CPUs, shared with the stub upstream and the load generator)")
    write_report("gateway-scaling", args, results=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
