"""What every benchmark shares: the closed loop, percentiles, argument types, tables, the
commit measured, CPU pinning and the prompts. Processes (free ports, health waits, stops, CPU
seconds) are launcher/processes.py's, shared with `dflash-serve` and the test fixtures."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "engine" / "assets" / "tiny-coder"


async def closed_loop(
    n: int, concurrency: int, send: Callable[[int], Awaitable[T]]
) -> tuple[list[T | None], float]:
    """`concurrency` users each sending request i (0..n-1, in order) as soon as their last
    one is answered, until all n are; the results by i and the wall seconds."""
    results: list[T | None] = [None] * n
    queue = list(range(n))[::-1]

    async def user() -> None:
        while queue:
            i = queue.pop()
            results[i] = await send(i)

    start = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(concurrency)))
    return results, time.perf_counter() - start


async def timed_loop(
    users: int, duration_s: float, user: Callable[[float], Awaitable[None]]
) -> float:
    """`users` copies of `user(deadline)` side by side, each sending its next request as soon
    as its last one finished until the deadline; the wall seconds they took."""
    start = time.perf_counter()
    await asyncio.gather(*(user(start + duration_s) for _ in range(users)))
    return time.perf_counter() - start


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank `q`-th percentile (0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers (every bench's lists)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers: {text!r}")
    return values


def positive_int(text: str) -> int:
    """argparse type: one positive integer (a bench's rounds)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer: {text!r}")
    return value


def share_of_one(text: str) -> float:
    """argparse type: a share strictly between 0 and 1 (a mixed stream's share of a class:
    both classes present)."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a share between 0 and 1: {text!r}")
    return value


def round_order(items: Sequence[T], r: int) -> list[T]:
    """Round r's order of the things compared side by side, from a Williams design: over a
    cycle of n rounds (2n when n is odd) each runs in every position equally often, so a
    drift over a round (a worker warming, a neighbour starting) falls on every one alike,
    and right after every other one equally often. Rotating one order (A B C, B C A, ...)
    would keep its neighbours: C would run just before A in almost every turn, so whatever
    a turn leaves behind (caches, a busy tail) would fall on A alone. Two things alternate
    (A B, B A)."""
    rows = williams_rows(len(items))
    return [items[i] for i in rows[r % len(rows)]]


def williams_rows(n: int) -> list[list[int]]:
    """The orders of a Williams design on n things: 0, 1, n-1, 2, n-2, ... shifted by each
    of 0..n-1, and for odd n the same reversed (each thing follows each other one exactly
    once per n rows, or twice per 2n)."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(x + shift) % n for x in first] for shift in range(n)] if n else [[]]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def aligned(rows: Sequence[Sequence[str]], sep: str = "  ") -> str:
    """Rows of cells as text columns, each as wide as its widest cell."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(sep.join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def git_commit() -> str | None:
    """The commit a report measured (None outside a checkout)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or None
    return None


def pinned(cpus: str | None, argv: list[str]) -> list[str]:
    """`argv` run on the CPUs `cpus` names (taskset), when given and available."""
    return ["taskset", "-c", cpus, *argv] if cpus and shutil.which("taskset") else argv


def bench_prompts(path: Path | None, n: int) -> list[str]:
    """`n` prompts (all for n <= 0): the held-out corpus by default, or a file of strings or
    `{"prompt": ...}` objects, as JSON or JSON lines."""
    if path is None:
        from engine.train.corpus import heldout_prompts

        return heldout_prompts(n)
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        items = json.loads(text)
    else:
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    prompts = [i if isinstance(i, str) else str(i["prompt"]) for i in items]
    return prompts[:n] if n > 0 else prompts
