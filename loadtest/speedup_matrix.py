"""`dflash-bench speedup --matrix`: DFlash against plain on every workload shape, in one table.

One workload tunes a policy; users send many. The matrix crosses, over the same two
`dflash-worker`s as `dflash-bench speedup` (DFlash adaptive, and plain):

- prompt length: short (8-48 tokens), medium (32-512), long (1024-1536);
- output: short (32-96 new tokens, EOS allowed) or long (256, `ignore_eos`);
- arrivals: a burst (each client sends one or two requests and stops) or a closed loop
  (each client sends `--requests-per-slot` requests back to back);
- temperature: 0, 0.7, or a mixed stream (greedy and 1.0 alternating, concurrently; in one
  shape every sampled request carries a seed);
- streaming for some shapes.

Every shape runs at every concurrency, A/B interleaved (the order changing by round so that
each worker runs after every other one alike: `round_order`; each run waiting until both
workers are quiet), so load on the machine weighs on both alike. A
cell sends at least `--min-requests` requests per worker and round: a small burst (one
request at c=1) is repeated, with the next requests of the workload, once the previous one
has ended, so that a cell is not one request's half second on a shared machine.
A cell's ratio is DFlash's generated tokens/s over plain's (completion tokens over the
rounds' wall time). A mixed shape also reports each class's per-request speed (its tokens
over its latency): sampled requests on DFlash against the same on plain, and greedy
requests on DFlash against the greedy requests of its greedy-only twin (the same requests,
every one at temperature 0) on DFlash. Prints a table and its worst cell; writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import platform
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from loadtest.backends_bench import (
    MODEL_NAME,
    RunningWorker,
    WorkerSpec,
    running_workers,
    settle,
    worker_env,
)
from loadtest.harness import closed_loop, git_commit, round_order
from loadtest.speedup_bench import (
    MATRIX_LONGEST,
    MATRIX_MAX_MODEL_LEN,
    REPO,
    Outcome,
    Request,
    build_workload,
    one_request,
    parse_args,
    worker_argv,
    write_report,
)

SHORT_PROMPT, MEDIUM_PROMPT, LONG_PROMPT = (8, 48), (32, 512), (1024, 1536)
SHORT_OUTPUT, LONG_OUTPUT = (32, 96), (256, 256)
assert LONG_PROMPT[1] + LONG_OUTPUT[1] == MATRIX_LONGEST  # what --matrix's options check
SAMPLED = 1.0  # the mixed stream's other half: drafts are then rarely accepted
STEP_SECONDS = "dflash:engine_step_seconds"  # the worker's profile, per kind of forward
KINDS = ("prefill", "drafting", "plain", "catch_up")
Arrivals = Literal["burst", "closed"]
# mixed: greedy and SAMPLED alternating; mixed-seeded: the same, each sampled request seeded
Temperature = Literal["0", "0.7", "mixed", "mixed-seeded"]


@dataclass(frozen=True)
class Shape:
    name: str
    prompt: tuple[int, int]
    output: tuple[int, int]
    ignore_eos: bool
    arrivals: Arrivals
    temperature: Temperature
    stream: bool = False
    twin: str | None = None  # a mixed shape's greedy-only twin

    def temperature_of(self, i: int) -> float:
        if self.temperature.startswith("mixed"):
            return 0.0 if i % 2 == 0 else SAMPLED
        return float(self.temperature)

    def seed_of(self, i: int) -> int | None:
        """Request i's seed: its index for a sampled request of a seeded mix, else none."""
        seeded = self.temperature == "mixed-seeded" and self.temperature_of(i) > 0
        return i if seeded else None

    def num_requests(self, c: int, per_slot: int) -> int:
        """A burst: client j sends 1 + j % 2 requests; a closed loop: per_slot each."""
        return c + c // 2 if self.arrivals == "burst" else c * per_slot

    def repeats(self, c: int, per_slot: int, least: int) -> int:
        """Bursts (or closed loops) back to back so that a cell sends at least `least`."""
        return max(1, -(-least // self.num_requests(c, per_slot)))


def _shape(
    name: str,
    prompt: tuple[int, int],
    output: Literal["short", "long"],
    arrivals: Arrivals,
    temperature: Temperature,
    stream: bool = False,
    twin: str | None = None,
) -> Shape:
    """Short outputs may end at EOS; long ones run to their 256 tokens (`ignore_eos`)."""
    long = output == "long"
    tokens = LONG_OUTPUT if long else SHORT_OUTPUT
    return Shape(name, prompt, tokens, long, arrivals, temperature, stream, twin)


SHAPES = (
    _shape("short-burst-t0", SHORT_PROMPT, "short", "burst", "0"),
    _shape("short-burst-mixed", SHORT_PROMPT, "short", "burst", "mixed", twin="short-burst-t0"),
    _shape(
        "short-burst-mixed-seeded",
        SHORT_PROMPT,
        "short",
        "burst",
        "mixed-seeded",
        twin="short-burst-t0",
    ),
    _shape("short-closed-t0.7", SHORT_PROMPT, "long", "closed", "0.7"),
    _shape("medium-closed-t0", MEDIUM_PROMPT, "long", "closed", "0"),
    _shape("medium-closed-t0-stream", MEDIUM_PROMPT, "short", "closed", "0", stream=True),
    _shape(
        "medium-closed-mixed-stream",
        MEDIUM_PROMPT,
        "short",
        "closed",
        "mixed",
        stream=True,
        twin="medium-closed-t0-stream",
    ),
    _shape("medium-burst-t0.7", MEDIUM_PROMPT, "short", "burst", "0.7"),
    _shape("long-burst-t0", LONG_PROMPT, "short", "burst", "0"),
    _shape("long-closed-t0.7", LONG_PROMPT, "long", "closed", "0.7"),
)
QUICK_SHAPES = (
    Shape("quick-t0", (8, 24), (4, 8), False, "burst", "0"),
    Shape("quick-mixed", (8, 24), (4, 8), True, "closed", "mixed", stream=True, twin="quick-t0"),
)
MAX_MODEL_LEN = MATRIX_MAX_MODEL_LEN  # the long prompts and answers fit the bundled context


def shapes_for(args: argparse.Namespace) -> tuple[Shape, ...]:
    """The matrix's shapes, or those --shapes names (and the greedy twins of mixed ones)."""
    every = QUICK_SHAPES if args.quick else SHAPES
    if not getattr(args, "shapes", None):
        return every
    unknown = set(args.shapes) - {s.name for s in every}
    if unknown:
        raise SystemExit(f"dflash-bench speedup --matrix: no shape {sorted(unknown)}")
    wanted = set(args.shapes) | {s.twin for s in every if s.name in args.shapes and s.twin}
    return tuple(s for s in every if s.name in wanted)


def modes(args: argparse.Namespace) -> list[str]:
    """The workers: DFlash (adaptive) and plain at every concurrency, with --control a
    second plain worker and with --dflash2 the bundled DFlash2 drafter's worker; at c=1 also
    DFlash verifying K drafts every step for each --fixed K; in every cell a --tree
    checkout's DFlash (a change can win at c=1 and lose in mixed batches). In the order
    they start (one at a time, unless --together), reversed by --reverse-starts: a worker
    started later can read faster than its identical twin started earlier, so a fine
    comparison is read from both orders, or with the workers started together
    (loadtest/README.md has the numbers)."""
    extra = [f"fixed-{k}" for k in args.fixed] + (["tree"] if args.tree is not None else [])
    base = ["dflash", "plain", *(["control"] if args.control else [])]
    order = [*base, *(["dflash2"] if args.dflash2 else []), *extra]
    return order[::-1] if args.reverse_starts else order


# In every cell (the control, DFlash2 and the --tree checkout's DFlash if started); the
# --fixed workers serve c=1 only.
BASE_MODES = ("dflash", "plain", "control", "dflash2", "tree")


# ---- cells ----------------------------------------------------------------------------------


@dataclass
class ClassSpeed:
    """Per-request speed of one class of requests: their tokens over their latencies."""

    tokens: int = 0
    latency_s: float = 0.0

    @property
    def speed(self) -> float | None:
        return self.tokens / self.latency_s if self.latency_s > 0 else None


@dataclass
class MatrixCell:
    tokens: int = 0
    elapsed_s: float = 0.0
    errors: int = 0
    rounds: list[float] = field(default_factory=list)  # tokens/s of each round
    acceptance_lengths: list[float] = field(default_factory=list)
    spec_steps: int = 0
    plain_steps: int = 0
    classes: dict[str, ClassSpeed] = field(default_factory=dict)
    # The engine's seconds per kind of forward over the cell's rounds (its /metrics).
    profile: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))

    def add_profile(self, before: dict[str, float], after: dict[str, float]) -> None:
        for kind in KINDS:
            self.profile[kind] += after[kind] - before[kind]

    def add(self, results: Sequence[Outcome | None], labels: Sequence[str], seconds: float) -> None:
        done = 0
        for result, label in zip(results, labels, strict=True):
            if result is None:
                self.errors += 1
                continue
            done += result.tokens
            speed = self.classes.setdefault(label, ClassSpeed())
            speed.tokens += result.tokens
            speed.latency_s += result.latency_s
            if result.acceptance_length is not None:
                self.acceptance_lengths.append(result.acceptance_length)
            self.spec_steps += result.spec_steps
            self.plain_steps += result.plain_steps
        self.tokens += done
        self.elapsed_s += seconds
        self.rounds.append(done / seconds if seconds > 0 else 0.0)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


Key = tuple[str, str, int]  # (worker mode, shape name, concurrency)


async def step_seconds(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The worker's cumulative engine seconds per kind of forward (its /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    response = await client.get(url + "/metrics")
    response.raise_for_status()
    out = dict.fromkeys(KINDS, 0.0)
    for family in text_string_to_metric_families(response.text):
        if family.name == STEP_SECONDS:
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("kind") in out:
                    out[sample.labels["kind"]] += sample.value
    return out


def class_of(temperature: float) -> str:
    return "greedy" if temperature == 0 else "sampled"


# ---- the run --------------------------------------------------------------------------------


def workloads(args: argparse.Namespace) -> dict[str, list[Request]]:
    """Each shape's requests, enough for its largest round (shared by both workers)."""
    per_slot, least = args.requests_per_slot, args.min_requests

    def size(s: Shape) -> int:
        return max(s.num_requests(c, per_slot) * s.repeats(c, per_slot, least)
                   for c in args.concurrency)  # fmt: skip

    return {s.name: build_workload(max(2, size(s)), s.prompt, s.output) for s in shapes_for(args)}


async def measure_matrix(
    workers: Sequence[RunningWorker],
    requests: dict[str, list[Request]],
    args: argparse.Namespace,
    rounds: Iterable[int],
    cells: dict[Key, MatrixCell],
) -> None:
    """Every cell's `rounds` on these workers, added to `cells`."""
    shapes = shapes_for(args)
    for key in ((w.spec.mode, s.name, c) for w in workers for s in shapes
                for c in args.concurrency if c == 1 or w.spec.mode in BASE_MODES):  # fmt: skip
        cells.setdefault(key, MatrixCell())
    # Idle connections are dropped before the worker's 5 s keep-alive ends: a request sent
    # on one the worker is closing fails with a ReadError, which is the client's race.
    limits = httpx.Limits(max_connections=max(args.concurrency) * 2, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        for w in workers:  # first-call allocations out of the timing
            warm = shapes[0]
            await _run(client, w.url, warm, requests[warm.name][:2], 2)
        for r in rounds:
            for shape in shapes:
                for c in args.concurrency:
                    workload = requests[shape.name]  # the cell's batches are its slices
                    await _measure_cell(client, workers, cells, workload, shape, c, r, args)


async def _measure_cell(
    client: httpx.AsyncClient,
    workers: Sequence[RunningWorker],
    cells: dict[Key, MatrixCell],
    requests: Sequence[Request],
    shape: Shape,
    c: int,
    r: int,
    args: argparse.Namespace,
) -> None:
    """One round of one cell: each worker serves the same batches, interleaved batch by
    batch (the workers' order changing with the round and the batch: `round_order`), so
    that a cell of small bursts compares the workers request by request and a slow spell of
    the shared machine falls on all of them, not on whichever ran in its window."""
    present = [w for w in workers if (w.spec.mode, shape.name, c) in cells]
    n = shape.num_requests(c, args.requests_per_slot)
    repeats = shape.repeats(c, args.requests_per_slot, args.min_requests)
    done: dict[str, list[Outcome | None]] = {w.spec.mode: [] for w in present}
    seconds = dict.fromkeys(done, 0.0)
    for j in range(repeats):
        batch = requests[j * n : (j + 1) * n]
        for w in round_order(present, r * repeats + j):
            await settle(workers)
            before = await step_seconds(client, w.url)
            results, took = await _run(client, w.url, shape, batch, c)
            done[w.spec.mode] += results
            seconds[w.spec.mode] += took
            cells[(w.spec.mode, shape.name, c)].add_profile(
                before, await step_seconds(client, w.url)
            )
    labels = [class_of(shape.temperature_of(i)) for _ in range(repeats) for i in range(n)]
    for w in present:
        cell = cells[(w.spec.mode, shape.name, c)]
        cell.add(done[w.spec.mode], labels, seconds[w.spec.mode])
        print(
            f"  round {r + 1}/{args.rounds} {shape.name} c={c} {w.spec.mode}: "
            f"{cell.rounds[-1]:.1f} tok/s",
            flush=True,
        )


async def _run(
    client: httpx.AsyncClient, url: str, shape: Shape, batch: Sequence[Request], c: int
) -> tuple[list[Outcome | None], float]:
    async def send(i: int) -> Outcome | None:
        temperature, seed = shape.temperature_of(i), shape.seed_of(i)
        return await one_request(
            client, url, batch[i], shape.stream, temperature, shape.ignore_eos, seed
        )

    return await closed_loop(len(batch), c, send)


# ---- the report -----------------------------------------------------------------------------


def matrix_rows(
    cells: dict[Key, MatrixCell], shapes: Sequence[Shape], cs: Sequence[int]
) -> list[Any]:
    rows = []
    for shape in shapes:
        for c in cs:
            fast, plain = cells[("dflash", shape.name, c)], cells[("plain", shape.name, c)]
            steps = fast.spec_steps + fast.plain_steps
            row: dict[str, Any] = {
                "shape": shape.name,
                "concurrency": c,
                "dflash_tokens_per_second": fast.tokens_per_second,
                "plain_tokens_per_second": plain.tokens_per_second,
                "ratio": _ratio(fast.tokens_per_second, plain.tokens_per_second),
                "ratio_per_round": [
                    f / p for f, p in zip(fast.rounds, plain.rounds, strict=True) if p > 0
                ],
                "mean_acceptance_length": _mean(fast.acceptance_lengths),
                "plain_step_share": fast.plain_steps / steps if steps else None,
                "generated_tokens": {"dflash": fast.tokens, "plain": plain.tokens},
                "profile": {"dflash": _shares(fast), "plain": _shares(plain)},
                "errors": fast.errors + plain.errors,
            }
            control = cells.get(("control", shape.name, c))
            if control is not None:  # two identical plain workers: the bench's own scatter
                row["control_ratio"] = _ratio(control.tokens_per_second, plain.tokens_per_second)
            second = cells.get(("dflash2", shape.name, c))
            if second is not None:  # the DFlash2 drafter, against plain and against DFlash
                row["dflash2_tokens_per_second"] = second.tokens_per_second
                row["dflash2_ratio"] = _ratio(second.tokens_per_second, plain.tokens_per_second)
                row["dflash2_vs_dflash"] = _ratio(second.tokens_per_second, fast.tokens_per_second)
                row["dflash2_mean_acceptance_length"] = _mean(second.acceptance_lengths)
                row["errors"] += second.errors
            if shape.twin is not None:
                row.update(_mixed(cells, shape, c))
            row.update(_against_others(cells, shape, c))
            rows.append(row)
    return rows


def _mixed(cells: dict[Key, MatrixCell], shape: Shape, c: int) -> dict[str, Any]:
    """A mixed shape's goals: sampled requests against plain, greedy ones against their
    greedy-only twin on DFlash."""
    fast, plain = cells[("dflash", shape.name, c)], cells[("plain", shape.name, c)]
    twin = cells[("dflash", shape.twin or "", c)]
    sampled = _ratio(_speed(fast, "sampled"), _speed(plain, "sampled"))
    greedy = _ratio(_speed(fast, "greedy"), _speed(twin, "greedy"))
    return {"sampled_vs_plain": sampled, "greedy_vs_greedy_only": greedy}


def _shares(cell: MatrixCell) -> dict[str, float]:
    """Each kind's engine seconds as a share of the cell's wall time."""
    wall = cell.elapsed_s
    return {kind: (cell.profile[kind] / wall if wall > 0 else 0.0) for kind in KINDS}


def _against_others(cells: dict[Key, MatrixCell], shape: Shape, c: int) -> dict[str, Any]:
    """Adaptive DFlash over each fixed-K worker and over the best of them (c=1), and over
    the --tree checkout's DFlash, overall and per round (tokens/s)."""
    speeds = {m: cell.tokens_per_second for (m, name, cc), cell in cells.items()
              if name == shape.name and cc == c}  # fmt: skip
    fast = speeds["dflash"]
    fixed = {m: v for m, v in speeds.items() if m.startswith("fixed-")}
    out: dict[str, Any] = {}
    if fixed:
        out["vs_fixed"] = {m: _ratio(fast, v) for m, v in fixed.items()}
        out["vs_best_fixed"] = _ratio(fast, max(fixed.values()))
    tree = cells.get(("tree", shape.name, c))
    if tree is not None:
        ours = cells[("dflash", shape.name, c)]
        out["tree_tokens_per_second"] = tree.tokens_per_second
        out["tree_ratio"] = _ratio(tree.tokens_per_second, speeds["plain"])
        out["tree_mean_acceptance_length"] = _mean(tree.acceptance_lengths)
        out["vs_tree"] = _ratio(fast, tree.tokens_per_second)
        out["vs_tree_per_round"] = [
            f / t for f, t in zip(ours.rounds, tree.rounds, strict=True) if t > 0
        ]
    return out


def _speed(cell: MatrixCell, label: str) -> float | None:
    speed = cell.classes.get(label)
    return None if speed is None else speed.speed


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The worst cell (what the README quotes), the mean, and the mixed streams' worst."""
    rated = [r for r in rows if r["ratio"] is not None]
    worst = min(rated, key=lambda r: r["ratio"]) if rated else None
    mixed = [r for r in rows if "sampled_vs_plain" in r]
    controls = [r["control_ratio"] for r in rows if r.get("control_ratio") is not None]
    second = [r for r in rows if r.get("dflash2_ratio") is not None]
    worst2 = min(second, key=lambda r: r["dflash2_ratio"]) if second else None
    return {
        "worst_ratio": None if worst is None else worst["ratio"],
        "worst_cell": None if worst is None else f"{worst['shape']} c={worst['concurrency']}",
        "mean_ratio": _mean([r["ratio"] for r in rated]),
        "cells_below_0.98": sum(r["ratio"] < 0.98 for r in rated),
        "cells": len(rated),
        "worst_sampled_vs_plain": _least(r.get("sampled_vs_plain") for r in mixed),
        "worst_greedy_vs_greedy_only": _least(r.get("greedy_vs_greedy_only") for r in mixed),
        "worst_vs_best_fixed_c1": _least(r.get("vs_best_fixed") for r in rows),
        "worst_vs_tree": _least(r.get("vs_tree") for r in rows),
        "control_range": [min(controls), max(controls)] if controls else None,
        "control_cells_below_0.98": sum(v < 0.98 for v in controls) if controls else None,
        # --dflash2: its worst cell against DFlash's (issue 45: no worse), and per cell
        "dflash2_worst_ratio": None if worst2 is None else worst2["dflash2_ratio"],
        "dflash2_worst_cell": None
        if worst2 is None
        else f"{worst2['shape']} c={worst2['concurrency']}",
        "dflash2_mean_ratio": _mean([r["dflash2_ratio"] for r in second]) if second else None,
        "dflash2_vs_dflash_range": [
            min(r["dflash2_vs_dflash"] for r in second),
            max(r["dflash2_vs_dflash"] for r in second),
        ]
        if second
        else None,
    }


def _least(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def format_matrix(report: dict[str, Any]) -> str:
    head = (
        f"{'shape':<28} {'c':>3} {'plain tok/s':>11} {'DFlash tok/s':>12} {'ratio':>6} "
        f"{'rounds':>11} {'A/A':>5} {'accept':>6} {'plain':>6} {'sampled':>8} {'greedy':>7} "
        f"{'err':>4} "
        f"{'DFlash time: prefill/draft/plain/catch-up %':>43}"
    )
    lines = [head, "-" * len(head)]
    for r in report["results"]:
        rounds = r["ratio_per_round"]
        span = f"{min(rounds):.2f}-{max(rounds):.2f}" if rounds else "-"
        lines.append(
            f"{r['shape']:<28} {r['concurrency']:>3} {r['plain_tokens_per_second']:>11.1f} "
            f"{r['dflash_tokens_per_second']:>12.1f} {_fmt(r['ratio'], '.2f'):>6} {span:>11} "
            f"{_fmt(r.get('control_ratio'), '.2f'):>5} "
            f"{_fmt(r['mean_acceptance_length'], '.2f'):>6} "
            f"{_fmt(r['plain_step_share'], '.0%'):>6} "
            f"{_fmt(r.get('sampled_vs_plain'), '.2f'):>8} "
            f"{_fmt(r.get('greedy_vs_greedy_only'), '.2f'):>7} {r['errors']:>4} "
            f"{_profile(r):>43}"
        )
    s = report["summary"]
    lines.append(
        f"worst cell: {_fmt(s['worst_ratio'], '.2f')} ({s['worst_cell']}); mean "
        f"{_fmt(s['mean_ratio'], '.2f')}; {s['cells_below_0.98']} of {s['cells']} cells below "
        f"0.98; mixed streams: sampled vs plain >= {_fmt(s['worst_sampled_vs_plain'], '.2f')}, "
        f"greedy vs greedy-only >= {_fmt(s['worst_greedy_vs_greedy_only'], '.2f')}; "
        f"c=1: vs best fixed k >= {_fmt(s['worst_vs_best_fixed_c1'], '.2f')}; "
        f"every cell: vs --tree >= {_fmt(s['worst_vs_tree'], '.2f')}"
    )
    if s.get("control_range"):
        low, high = s["control_range"]
        lines.append(
            f"A/A (a second plain worker over plain, every cell): {low:.2f}-{high:.2f}, "
            f"{s['control_cells_below_0.98']} of {s['cells']} cells below 0.98"
        )
    if s.get("dflash2_vs_dflash_range"):
        lines += ["", _dflash2_table(report["results"], s)]
    if s.get("worst_vs_tree") is not None:
        lines += ["", _tree_table(report["results"])]
    return "\n".join(lines)


# A side table's column: its title, its width and its text in a row.
Column = tuple[str, int, Callable[[dict[str, Any]], str]]


def _column(title: str, key: str, spec: str = ".2f") -> Column:
    """A column of one row field, as wide as its title."""
    return (title, len(title), lambda r: _fmt(r[key], spec))


def _side_table(rows: Sequence[dict[str, Any]], key: str, columns: Sequence[Column]) -> list[str]:
    """A table of the rows that have `key`: shape, c, then `columns`."""
    head = " ".join([f"{'shape':<28} {'c':>3}", *(f"{title:>{w}}" for title, w, _ in columns)])
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get(key) is not None:
            cells = (f"{text(r):>{w}}" for _, w, text in columns)
            lines.append(" ".join([f"{r['shape']:<28} {r['concurrency']:>3}", *cells]))
    return lines


def _round_span(r: dict[str, Any]) -> str:
    rounds = r["vs_tree_per_round"]
    return f"{min(rounds):.2f}-{max(rounds):.2f}" if rounds else "-"


def _tree_table(rows: Sequence[dict[str, Any]]) -> str:
    """--tree: each cell's DFlash over plain for this checkout and the other, and this
    checkout's DFlash over the other's, overall and its spread over the rounds."""
    columns = [
        _column("tree tok/s", "tree_tokens_per_second", ".1f"),
        _column("tree/plain", "tree_ratio"),
        _column("DFlash/plain", "ratio"),
        _column("DFlash/tree", "vs_tree"),
        ("rounds", 11, _round_span),
        _column("accept", "mean_acceptance_length"),
        _column("tree accept", "tree_mean_acceptance_length"),
    ]
    return "\n".join(_side_table(rows, "vs_tree", columns))


def _dflash2_table(rows: Sequence[dict[str, Any]], s: dict[str, Any]) -> str:
    """--dflash2: each cell's DFlash2 and DFlash over plain, and DFlash2 over DFlash."""
    columns = [
        _column("DFlash2 tok/s", "dflash2_tokens_per_second", ".1f"),
        _column("DFlash2/plain", "dflash2_ratio"),
        _column("DFlash/plain", "ratio"),
        _column("DFlash2/DFlash", "dflash2_vs_dflash"),
        _column("accept", "dflash2_mean_acceptance_length"),
    ]
    lines = _side_table(rows, "dflash2_ratio", columns)
    low, high = s["dflash2_vs_dflash_range"]
    lines.append(
        f"DFlash2 worst cell: {_fmt(s['dflash2_worst_ratio'], '.2f')} "
        f"({s['dflash2_worst_cell']}) against DFlash's {_fmt(s['worst_ratio'], '.2f')} "
        f"({s['worst_cell']}); mean {_fmt(s['dflash2_mean_ratio'], '.2f')} against "
        f"{_fmt(s['mean_ratio'], '.2f')}; DFlash2 / DFlash per cell {low:.2f}-{high:.2f}"
    )
    return "\n".join(lines)


def _profile(row: dict[str, Any]) -> str:
    shares = row.get("profile", {}).get("dflash")
    return "/".join(f"{100 * shares[k]:.0f}" for k in KINDS) if shares else "-"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def matrix_report(
    args: argparse.Namespace,
    requests: dict[str, list[Request]],
    cells: dict[Key, MatrixCell],
    load: list[float],
    workers: dict[str, list[str]],
) -> dict[str, Any]:
    shapes = shapes_for(args)
    rows = matrix_rows(cells, shapes, args.concurrency)
    config = {k: str(v) if not isinstance(v, (int, float, list, bool)) else v
              for k, v in vars(args).items()}  # fmt: skip
    return {
        "benchmark": "speedup-matrix",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "model": MODEL_NAME,
        "config": config,
        "workers": workers,
        "shapes": [asdict(s) for s in shapes],
        "workload": {name: [r.prompt_tokens for r in reqs] for name, reqs in requests.items()},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_average": load},
        "results": rows,
        "summary": summary(rows),
    }


def launches(
    specs: Sequence[WorkerSpec], args: argparse.Namespace, log_dir: Path
) -> list[tuple[list[WorkerSpec], range, Path]]:
    """Each start of the workers (in its order), the rounds it serves and its log folder:
    one start for every round, or with `--restarts` one per round, in the reverse order
    every other round and its logs in a folder of its own. A worker process can run its
    steps a few percent faster or slower than its twin for its whole life (two adaptive
    workers of one commit, started first and last: 2-6 % apart per step,
    loadtest/RESULTS.md), which no number of rounds on the same processes averages out."""
    if not args.restarts:
        return [(list(specs), range(args.rounds), log_dir)]
    return [
        (list(specs)[:: 1 if r % 2 == 0 else -1], range(r, r + 1), log_dir / f"round-{r + 1}")
        for r in range(args.rounds)
    ]


def measure_started(
    specs: Sequence[WorkerSpec],
    requests: dict[str, list[Request]],
    args: argparse.Namespace,
    log_dir: Path,
    env: Callable[[WorkerSpec, int], dict[str, str]],
    cwd: Callable[[WorkerSpec], Path],
) -> dict[Key, MatrixCell]:
    """Every cell over every round, the workers started as `launches` says."""
    cells: dict[Key, MatrixCell] = {}
    for order, rounds, folder in launches(specs, args, log_dir):
        folder.mkdir(parents=True, exist_ok=True)
        with running_workers(
            order, args, folder, argv=worker_argv, env=env, cwd=cwd, together=args.together
        ) as workers:
            asyncio.run(measure_matrix(workers, requests, args, rounds, cells))
    return cells


def main(argv: Sequence[str] | None = None) -> int:
    """`dflash-bench speedup --matrix`: every shape, A/B, one table."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    requests = workloads(args)
    specs = [WorkerSpec("embedded", mode) for mode in modes(args)]
    tree = (args.tree or REPO).resolve()

    def cwd(spec: WorkerSpec) -> Path:
        return tree if spec.mode == "tree" else REPO

    def env(spec: WorkerSpec, threads: int) -> dict[str, str]:
        out = worker_env(spec, threads)
        out["PYTHONPATH"] = str(cwd(spec))
        return out

    with contextlib.ExitStack() as stack:
        log_dir = args.log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        log_dir.mkdir(parents=True, exist_ok=True)
        cells = measure_started(specs, requests, args, log_dir, env, cwd)
    argvs = {s.mode: worker_argv(s, 0, args)[1:] for s in specs}
    report = matrix_report(args, requests, cells, list(os.getloadavg()), argvs)
    print(format_matrix(report))
    return write_report(report, args.json)
