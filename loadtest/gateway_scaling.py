"""`dflash-bench gateway --scaling`: requests/s of one gateway started with `--processes N`
(SO_REUSEPORT, the kernel spreading connections), for each N, in interleaved rounds.

Nothing is pinned: the gateway's processes, the stub upstream and the load generator share
the machine's cores, so the total requests/s stops growing once the cores are busy. What
says whether the gateway itself scales is its own CPU: the cores its processes kept busy and
the CPU each request cost against one process's (1.0 = each added process adds a core's
worth; less = the processes get in each other's way). Per N: requests/s and its ratio to one
process, gateway cores busy, CPU µs per request and that efficiency, each process's share of
the gateway's CPU (the kernel spreads connections, not requests: a lopsided split shows
here), errors. A slice starts once every process listens. Prints a table, writes JSON.

On a machine with more cores the load generator and the stub (one process each) may bound
the total requests/s before the gateway does: read the efficiency and the shares then.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.processes import cpu_by_process, free_port, stop, wait_healthy
from loadtest.gateway_bench import (
    Sample,
    body,
    closed_loop,
    without_collector,
    write_report,
)
from loadtest.gateway_peers import start_gateway, stub_process
from loadtest.harness import aligned


@dataclass
class Totals:
    completed: int = 0
    errors: int = 0
    elapsed_s: float = 0.0
    cpu_s: float = 0.0
    # CPU seconds of each gateway process, busiest first, summed over slices
    by_process: list[float] = field(default_factory=list)

    def add_processes(self, seconds: list[float]) -> None:
        ranked = sorted(seconds, reverse=True)
        if not self.by_process:
            self.by_process = [0.0] * len(ranked)
        self.by_process = [a + b for a, b in zip(self.by_process, ranked, strict=True)]


def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,2: {text!r}")
    return values


def listeners(port: int) -> int:
    """Sockets listening on `port`: one per process of `--processes N` (SO_REUSEPORT)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            count += state == "0A" and int(local.rsplit(":", 1)[1], 16) == port  # 0A: LISTEN
    return count


def wait_listening(port: int, processes: int, gateway: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while listeners(port) < processes:
        if gateway.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{processes} gateway processes did not all listen on {port}")
        time.sleep(0.1)


def serving_pids(gateway: subprocess.Popen[bytes], processes: int) -> list[int]:
    """The processes that serve: the gateway itself, or its supervisor's children."""
    pids = list(cpu_by_process(gateway.pid))
    return pids if processes == 1 else [p for p in pids if p != gateway.pid]


async def measure(
    port: int, pids: list[int], gateway_pid: int, args: argparse.Namespace
) -> tuple[Sample, dict[int, float]]:
    """A closed loop of unary requests; the sample and each serving process's CPU seconds."""
    await closed_loop(port, body(False), 8, args.warmup, False)
    before = cpu_by_process(gateway_pid)
    loop = closed_loop(port, body(False), args.concurrency, args.duration, False)
    sample = await without_collector(loop)
    after = cpu_by_process(gateway_pid)
    return sample, {p: after.get(p, 0.0) - before.get(p, 0.0) for p in pids}


def one_slice(processes: int, upstream: int, args: argparse.Namespace, into: Totals) -> None:
    """A fresh gateway with this many processes, measured, stopped."""
    port = free_port()
    gateway = start_gateway(port, upstream, ["--processes", str(processes)], None)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/ready", gateway, 60, interval=0.1)
        wait_listening(port, processes, gateway)
        pids = serving_pids(gateway, processes)
        sample, cpu = asyncio.run(measure(port, pids, gateway.pid, args))
    finally:
        stop(gateway)
    into.completed += sample.completed
    into.errors += sample.errors
    into.elapsed_s += sample.elapsed_s
    into.cpu_s += sum(cpu.values())
    into.add_processes(list(cpu.values()))


def row(processes: int, totals: Totals, one: Totals) -> dict[str, Any]:
    rate = totals.completed / totals.elapsed_s if totals.elapsed_s else 0.0
    one_rate = one.completed / one.elapsed_s if one.elapsed_s else 0.0
    cost = totals.cpu_s / totals.completed * 1e6 if totals.completed else None
    one_cost = one.cpu_s / one.completed * 1e6 if one.completed else None
    return {
        "processes": processes,
        "requests_per_s": round(rate, 1),
        "vs_one_process": round(rate / one_rate, 2) if one_rate else None,
        "gateway_cores_busy": round(totals.cpu_s / totals.elapsed_s, 2) if totals.elapsed_s else 0,
        "cpu_us_per_request": round(cost, 1) if cost else None,
        # one process's CPU per request over this one's: 1.0 = perfect scaling per core
        "efficiency": round(one_cost / cost, 2) if cost and one_cost else None,
        "process_cpu_shares": [round(s / totals.cpu_s, 2) for s in totals.by_process]
        if totals.cpu_s
        else [],
        "errors": totals.errors,
    }


COLUMNS = (
    "processes",
    "requests_per_s",
    "vs_one_process",
    "gateway_cores_busy",
    "cpu_us_per_request",
    "efficiency",
)


def table(rows: list[dict[str, Any]]) -> str:
    head = ("processes", "req/s", "x 1 process", "gateway cores", "CPU µs/req", "efficiency")
    lines: list[tuple[str, ...]] = [(*head, "CPU shares", "errors")]
    for r in rows:
        shares = "/".join(str(s) for s in r["process_cpu_shares"])
        lines.append((*(str(r[k]) for k in COLUMNS), shares, str(r["errors"])))
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
