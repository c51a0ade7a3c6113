"""`dflash-bench fleet`: a mixed stream over a DFlash pool and a plain pool, routed by every
static split and by the gateway's `ROUTING=fastest` (docs/gateway.md), side by side.

Two embedded `dflash-worker`s serve the bundled tiny-coder as a user starts them: one with
DFlash (its default, adaptive speculation), one plain (`--no-speculation`). Two gateways front
them, as pools `dflash` and `plain` of one model:
- `weights`: the static splits, each set through the admin API's pins (`PUT /admin/pools`):
  everything to DFlash, everything to plain, 25/50/75 % to DFlash;
- `fastest`: `--routing fastest`, warmed up on the same stream before each concurrency is
  measured (its estimates form online, as they would in production).
The split by class (greedy requests to DFlash, sampled ones to plain) is the client's: it
sends each class to a gateway fronting that pool alone. Every routing pays one gateway hop:
on this 2-core machine, with each worker pinned to a core, a gateway's CPU is taken from the
workers (sent straight to the workers, the split by class ran 1.12x the same split through
a gateway at c = 16).

The stream: requests from loadtest/prompts/mix.jsonl, greedy and temperature 1.0 in decks
shuffled by a fixed seed (`--order`, Stream), `--max-tokens` new tokens each, a closed loop of
c clients for each c in `--concurrency`. Per (c, routing): the stream's decode tokens/s
(completion tokens over wall time), and each class's mean per-request tokens/s. `--rounds R`
runs each routing's requests at each c in R chunks, every routing once a round on the same
requests, in turn and then in reverse (A/B, B/A): on a shared machine a slow spell of tens of
seconds then falls on every routing alike, not on whichever cell ran in it, nor on the one that
runs last. Each cell also gives each class's pool shares (equal pool shares can hide classes
crossing over). `--control` runs the split by class twice, an A/A control: two identical
routings differ by noise alone. Goals (issue: speculation-aware fleet): `fastest` at least the
best static split at every c, and no class below 0.9x its speed under that split. Prints a
table and writes JSON. The JSON also says why `fastest` sent each measured request where it did
(`fastest_choices`: per class and pool, how many by its rule, with its lean waived, exploring
onto an idle worker or under load, or by weights), read from that gateway's own debug log of
its choices (logger `dflash.gateway.fastest`, alone at debug).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import platform
import random
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from launcher.processes import free_port, stop, wait_healthy
from loadtest.backends_bench import (
    MODEL_NAME,
    RunningWorker,
    WorkerSpec,
    running_workers,
    worker_env,
)
from loadtest.gateway_peers import start_gateway
from loadtest.harness import (
    aligned,
    closed_loop,
    git_commit,
    int_list,
    pinned,
    positive_int,
    round_order,
    share_of_one,
)
from loadtest.speedup_bench import worker_argv

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "loadtest" / "prompts" / "mix.jsonl"
STATIC = {"dflash": 100.0, "plain": 0.0, "75/25": 75.0, "50/50": 50.0, "25/75": 25.0}
CLASSES = ("greedy", "sampled")
# `--control`: the split by class a second time, in the same rounds. Not a candidate for the
# best static split; it over the split by class is the bench's resolution.
CONTROL = "by class (A/A)"
NOT_STATIC = ("fastest", CONTROL)


def stream_prompts() -> list[str]:
    prompts = []
    for line in PROMPTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            item = json.loads(line)
            if "prompt" in item:
                prompts.append(str(item["prompt"]))
    return prompts


# How the stream orders its classes and prompts (`--order`).
ORDERS = ("shuffled", "interleaved")


@functools.lru_cache(maxsize=1024)
def deck(size: int, key: str) -> tuple[int, ...]:
    """0..size-1 in an order seeded by `key` (the same on every run and machine)."""
    order = list(range(size))
    random.Random(key).shuffle(order)
    return tuple(order)


@dataclass(frozen=True)
class Stream:
    """The mixed stream: `greedy_share` of the requests greedy, the others at temperature 1.0,
    `max_tokens` new tokens each. Interleaved, the classes as evenly as they go and the prompts
    in turn, a request's class and prompt follow its index: with 16 prompts and three quarters
    greedy each prompt always had the same class, and the weights gateway's smooth round robin
    sent every even request to one pool, so its "50/50 split" sent the DFlash pool the greedy
    requests of the even prompts only (accepting 5.5 tokens a step against the odd ones' 4.0),
    a split by prompt that no router and no real traffic gets. Shuffled (the default), each
    deck of len(prompts) requests holds the interleaved deck's classes and prompts, each in an
    order of its own, seeded by the deck's number."""

    prompts: Sequence[str]
    max_tokens: int = 64
    greedy_share: float = 0.5
    order: str = "shuffled"

    def position(self, i: int, what: str) -> int:
        """Where request i's class or prompt (`what`) comes from in the interleaved stream."""
        if self.order == "interleaved":
            return i
        size = len(self.prompts)
        number, at = divmod(i, size)
        return number * size + deck(size, f"{what}-{number}")[at]

    def greedy(self, i: int) -> bool:
        share, at = self.greedy_share, self.position(i, "class")
        return math.ceil((at + 1) * share) > math.ceil(at * share)  # request 0 greedy

    def klass(self, i: int) -> str:
        return CLASSES[0] if self.greedy(i) else CLASSES[1]

    def body(self, i: int) -> dict[str, Any]:
        prompt = self.prompts[self.position(i, "prompt") % len(self.prompts)]
        return {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.max_tokens,
            "temperature": 0.0 if self.greedy(i) else 1.0,
        }


@dataclass
class Served:
    tokens: int
    seconds: float
    klass: str
    pool: str


@dataclass
class Cell:
    """One routing at one concurrency."""

    wall_s: float = 0.0
    served: list[Served] = field(default_factory=list)
    errors: int = 0

    @property
    def tokens_per_s(self) -> float:
        return sum(s.tokens for s in self.served) / self.wall_s if self.wall_s else 0.0

    def class_speed(self, name: str) -> float | None:
        speeds = [s.tokens / s.seconds for s in self.served if s.klass == name and s.seconds]
        return sum(speeds) / len(speeds) if speeds else None

    def add(self, other: Cell) -> None:
        """Another round of the same routing: its requests and its wall time."""
        self.wall_s += other.wall_s
        self.served += other.served
        self.errors += other.errors

    def shares(self, klass: str | None = None) -> dict[str, float]:
        """Each pool's share of the requests (of one class when given)."""
        served = [s for s in self.served if klass is None or s.klass == klass]
        pools = sorted({s.pool for s in served})
        return {pool: sum(s.pool == pool for s in served) / (len(served) or 1) for pool in pools}

    def row(self) -> dict[str, Any]:
        speeds = {name: self.class_speed(name) for name in CLASSES}
        return {
            "tokens_per_s": round(self.tokens_per_s, 1),
            "class_tokens_per_s": {k: round(v, 1) if v else None for k, v in speeds.items()},
            "pool_shares": {k: round(v, 3) for k, v in self.shares().items()},
            # Equal pool shares may hide classes crossing over: each class's own.
            "class_pool_shares": {
                name: {k: round(v, 3) for k, v in self.shares(name).items()} for name in CLASSES
            },
            "requests": len(self.served),
            "errors": self.errors,
        }


FAILED = "failed"  # the `pool` of a request that got no answer

# The `fastest` gateway's log of its choices (service/routing/fastest.py's debug lines):
# "<class> to <pool>[ (no lean: ...)]: <why, or each pool's speed>"; a class is the gateway's
# (service/routing/promotion.py request_class: "greedy/short", ...).
CHOICE = re.compile(r"dflash\.gateway\.fastest: ([\w/]+) to ([\w-]+)( \(no lean[^)]*\))?: (.*)$")
FASTEST_LOGGER = "dflash.gateway.fastest=debug"


def choice_reason(waived: bool, said: str) -> str:
    if said.startswith("exploring onto an idle"):
        return "exploring"
    if said.startswith("exploring"):  # no worker idle: onto a pool no busier than its pick
        return "exploring under load"
    if said.startswith("by weights"):
        return "by weights"
    return "rule, no lean" if waived else "rule"


@dataclass
class ChoiceLog:
    """The `fastest` gateway's output file, read by span: each cell's choices are the lines
    written while it ran (a choice is logged as its request is routed, before any reply)."""

    path: Path

    def mark(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def counts(self, offset: int) -> Counter[tuple[str, str, str]]:
        """The choices logged after `offset`, by (class, pool, reason)."""
        with self.path.open("rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
        found = (CHOICE.search(line) for line in text.splitlines())
        return Counter(
            (klass, pool, choice_reason(waived is not None, said))
            for klass, pool, waived, said in (m.groups() for m in found if m)
        )


def nested(counts: Counter[tuple[str, str, str]]) -> dict[str, dict[str, dict[str, int]]]:
    """{class: {pool: {reason: n}}}, as the JSON reads them."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for (klass, pool, reason), n in sorted(counts.items()):
        out.setdefault(klass, {}).setdefault(pool, {})[reason] = n
    return out


async def one(client: httpx.AsyncClient, url: str, stream: Stream, i: int) -> Served:
    started = time.perf_counter()
    klass = stream.klass(i)
    try:
        reply = await client.post(url + "/v1/chat/completions", json=stream.body(i))
    except httpx.HTTPError:
        return Served(0, 0.0, klass, FAILED)
    if reply.status_code != 200:
        return Served(0, 0.0, klass, FAILED)
    tokens = int(reply.json()["usage"]["completion_tokens"])
    pool = reply.headers.get("x-dflash-pool", "direct")
    return Served(tokens, time.perf_counter() - started, klass, pool)


async def run_cell(urls: Sequence[str], n: int, c: int, stream: Stream, offset: int) -> Cell:
    """n requests of the stream at concurrency c, to urls[0]; with two, the client's split by
    class: greedy requests to the first, sampled ones to the second."""
    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=c + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits, trust_env=False) as client:

        async def send(i: int) -> Served:
            j = i + offset
            url = urls[0] if len(urls) == 1 or stream.greedy(j) else urls[1]
            return await one(client, url, stream, j)

        results, wall = await closed_loop(n, c, send)
    cell = Cell(wall_s=wall)
    for result in results:
        if result is None or result.pool == FAILED:
            cell.errors += 1
        else:
            cell.served.append(result)
    return cell


def pin(base_url: str, dflash_share: float) -> None:
    shares = (("dflash", dflash_share), ("plain", 100.0 - dflash_share))
    # The weighted pool first: a pin to 0 that would leave both pools at 0 is refused.
    for pool, weight in sorted(shares, key=lambda share: share[1] == 0):
        reply = httpx.put(f"{base_url}/admin/pools/{pool}", json={"weight": weight}, timeout=10)
        reply.raise_for_status()


@contextlib.contextmanager
def gateways(workers: Sequence[RunningWorker], workdir: Path) -> Iterator[dict[str, str]]:
    """The `weights` and `fastest` gateways over the two workers, as pools of one model; and
    one gateway per pool, for the split by class (so that every routing pays one gateway
    hop: on this machine a gateway's CPU is taken from the workers' cores)."""
    by_mode = {w.spec.mode: w for w in workers}

    def pools_file(name: str, modes: Sequence[str]) -> Path:
        path = workdir / f"pools-{name}.json"
        pools = [
            {
                "name": mode,
                "model": MODEL_NAME,
                "engine": "embedded",
                "workers": [by_mode[mode].url],
            }
            for mode in modes
        ]
        path.write_text(json.dumps(pools))
        return path

    both = pools_file("both", list(by_mode))
    fastest = ["--routing", "fastest", "--log-levels", FASTEST_LOGGER]
    fronts = [("weights", [], both), ("fastest", fastest, both)]
    fronts += [(mode, [], pools_file(mode, [mode])) for mode in by_mode]
    started = []
    urls = {}
    try:
        for name, extra, pools in fronts:
            port = free_port()
            log = workdir / "fastest.log" if name == "fastest" else None
            process = start_gateway(port, 0, extra, None, REPO, pools, log=log)
            started.append(process)
            urls[name] = f"http://127.0.0.1:{port}"
            wait_healthy(urls[name] + "/ready", process, 60, interval=0.2)
        yield urls
    finally:
        for process in started:
            stop(process)


async def measure(
    urls: dict[str, str], args: argparse.Namespace, choices: ChoiceLog | None = None
) -> list[dict[str, Any]]:
    stream = Stream(stream_prompts(), args.max_tokens, args.greedy_share, args.order)
    # (name, the URL, or the greedy and the sampled requests' URLs, the weights gateway's pin)
    routings: list[tuple[str, list[str], float | None]] = [
        (name, [urls["weights"]], share) for name, share in STATIC.items()
    ]
    routings += [
        ("by class", [urls["dflash"], urls["plain"]], None),  # greedy to DFlash
        ("fastest", [urls["fastest"]], None),
    ]
    if args.control:
        routings.append((CONTROL, [urls["dflash"], urls["plain"]], None))
    rows = []
    offset = 0
    for c in args.concurrency:
        n = max(args.min_requests, args.requests_per_client * c)
        chunk = max(n // args.rounds, 1)
        # Not measured: the estimates at this load form (each pool, class and load level
        # needs a few samples before it is used: service/routing/fastest.py MIN_SAMPLES).
        warm_n = max(n // 2, args.warmup_requests)
        await run_cell([urls["fastest"]], warm_n, c, stream, offset + n)
        cells: dict[str, Cell] = {}
        chosen: Counter[tuple[str, str, str]] = Counter()
        for r in range(args.rounds):  # every routing once a round, on the same requests
            at = offset + r * chunk
            for name, targets, share in round_order(routings, r):
                if share is not None:
                    pin(urls["weights"], share)
                before = choices.mark() if choices and name == "fastest" else None
                cell = await run_cell(targets, chunk, c, stream, at)
                cells.setdefault(name, Cell()).add(cell)
                if choices and before is not None:
                    chosen += choices.counts(before)
        offset += n + warm_n
        rows.append(judge(c, cells))
        if choices:
            rows[-1]["fastest_choices"] = nested(chosen)
        print(format_row(rows[-1]), flush=True)
    return rows


def judge(c: int, cells: dict[str, Cell]) -> dict[str, Any]:
    static = {name: cell for name, cell in cells.items() if name not in NOT_STATIC}
    best = max(static, key=lambda name: static[name].tokens_per_s)
    fastest = cells["fastest"]
    ratio = fastest.tokens_per_s / static[best].tokens_per_s if static[best].tokens_per_s else None
    class_ratios = {}
    for name in CLASSES:
        ours, theirs = fastest.class_speed(name), static[best].class_speed(name)
        class_ratios[name] = round(ours / theirs, 3) if ours and theirs else None
    met = (
        ratio is not None
        and ratio >= 1.0
        and all(r is None or r >= 0.9 for r in class_ratios.values())
    )
    control, by_class = cells.get(CONTROL), cells.get("by class")
    return {
        "concurrency": c,
        "cells": {name: cell.row() for name, cell in cells.items()},
        "best_static": best,
        "fastest_over_best": round(ratio, 3) if ratio else None,
        "class_over_best": class_ratios,
        # Two identical routings, the split by class twice: how far apart noise sets them.
        "control_over_by_class": (
            round(control.tokens_per_s / by_class.tokens_per_s, 3)
            if control and by_class and by_class.tokens_per_s
            else None
        ),
        "met": met,
    }


def format_row(row: dict[str, Any]) -> str:
    cells = row["cells"]
    parts = [f"c={row['concurrency']}"]
    parts += [f"{name} {cell['tokens_per_s']}" for name, cell in cells.items()]
    parts.append(f"best static: {row['best_static']}, fastest/best {row['fastest_over_best']}")
    return " | ".join(parts)


def table(rows: Sequence[dict[str, Any]]) -> str:
    names = list(rows[0]["cells"]) if rows else []
    control = any(row["control_over_by_class"] is not None for row in rows)
    header = ["c", *names, "best static", "fastest/best", "greedy", "sampled", "goal"]
    lines = [header + ["A/A"] * control]
    for row in rows:
        lines.append(
            [
                str(row["concurrency"]),
                *(f"{row['cells'][n]['tokens_per_s']:.0f}" for n in names),
                row["best_static"],
                str(row["fastest_over_best"]),
                str(row["class_over_best"]["greedy"]),
                str(row["class_over_best"]["sampled"]),
                "met" if row["met"] else "NOT met",
            ]
            + [str(row["control_over_by_class"])] * control
        )
    return aligned(lines, " | ")


def pool_cores(pin: bool) -> dict[str, str]:
    """Each pool's worker on a core of its own (`--pin`, the default with two or more cores):
    in production a pool has GPUs of its own, and two workers sharing this machine's cores
    would slow each other whenever traffic is split, which no GPU fleet sees."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not pin or len(cpus) < 2:
        return {}
    return {"dflash": str(cpus[0]), "plain": str(cpus[1])}


def add_worker_options(p: argparse.ArgumentParser, max_num_seqs: int) -> None:
    """The pools' embedded workers, as running_workers starts them (also dflash-bench
    promotion's)."""
    p.add_argument("--max-num-seqs", type=int, default=max_num_seqs)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--port-base", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each pool's worker on a core of its own, as pools have their own GPUs",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-bench fleet", description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 8, 16, 32])
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--min-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--greedy-share",
        type=share_of_one,
        default=0.5,
        help="the stream's share of greedy requests (the others at temperature 1.0)",
    )
    p.add_argument(
        "--order",
        choices=ORDERS,
        default="shuffled",
        help="the stream's classes and prompts: each deck of requests shuffled, or interleaved "
        "in turn (as before 2026-12-01; then the weights gateway's round robin locks onto the "
        "prompts: see Stream)",
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="each routing's requests at each c in this many interleaved chunks (A/B, B/A): "
        "a slow spell of a shared machine falls on every routing alike",
    )
    p.add_argument(
        "--warmup-requests", type=int, default=48, help="fastest's warm-up at each concurrency"
    )
    p.add_argument(
        "--control",
        action="store_true",
        help="run the split by class twice (an A/A control in the same rounds): the "
        "resolution of fastest over the best static split",
    )
    add_worker_options(p, max_num_seqs=32)
    p.add_argument("--quick", action="store_true", help="c=2, a few short requests (CI)")
    p.add_argument("--out", type=Path, default=Path("bench-results/fleet.json"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.concurrency, args.requests_per_client, args.min_requests = [2], 2, 4
        args.warmup_requests = 4
        args.max_tokens = 8
    specs = [WorkerSpec("embedded", "dflash"), WorkerSpec("embedded", "plain")]
    cores = pool_cores(args.pin)

    def pinned_argv(spec: WorkerSpec, port: int, options: argparse.Namespace) -> list[str]:
        return pinned(cores.get(spec.mode), worker_argv(spec, port, options))

    with tempfile.TemporaryDirectory(prefix="dflash-fleet-") as tmp:
        workdir = Path(tmp)
        with (
            running_workers(specs, args, workdir, pinned_argv, worker_env) as workers,
            gateways(workers, workdir) as urls,
        ):
            rows = asyncio.run(measure(urls, args, ChoiceLog(workdir / "fastest.log")))
    print(table(rows))
    report = {
        "benchmark": "fleet",
        "commit": git_commit(),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "rows": rows,
        "met": all(row["met"] for row in rows),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
