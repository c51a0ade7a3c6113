"""`dflash-bench sweep`: throughput at fixed interactivity, one curve per target.

    dflash-bench sweep --target plain=http://127.0.0.1:8100 --target dflash=http://127.0.0.1:8000 \
        --concurrency 1,2,4,8 --duration 60 --out-dir sweep-results

For every target and concurrency N it runs Locust headless (`loadtest/locustfile.py`, N
closed-loop users for --duration seconds), reads the per-request records the locustfile
writes, and computes one point: total output tokens/s (tokens generated inside the run's
window, divided by its length) against per-user tokens/s (mean over requests of 1/TPOT).
It writes sweep.csv, sweep.json and sweep.png into --out-dir, prints the table and, at one
interactivity level (default: what the baseline, the first target unless --baseline, reaches
at its lowest concurrency), each target's throughput interpolated on its curve and the
ratio to the baseline.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

from loadtest.chat_stream import DEFAULT_PROMPTS, RequestRecord

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
EstimateKind = Literal["interpolated", "lower_bound", "unreachable"]


@dataclass(frozen=True)
class Target:
    name: str
    url: str


@dataclass(frozen=True)
class Point:
    """One (target, concurrency) run, summarised."""

    target: str
    url: str
    concurrency: int
    duration_s: float
    requests: int
    failures: int
    output_tokens: int
    throughput_tok_s: float
    per_user_tok_s: float | None
    ttft_ms: float | None
    tpot_ms: float | None
    acceptance_length: float | None


@dataclass(frozen=True)
class Estimate:
    """A target's throughput at the chosen interactivity, and how it was obtained."""

    target: str
    throughput_tok_s: float | None
    kind: EstimateKind
    ratio: float | None = None  # to the baseline's estimate


def parse_target(text: str) -> Target:
    name, sep, url = text.partition("=")
    if not sep or not name.strip() or not url.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=URL, got {text!r}")
    if not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"URL must start with http:// or https://: {url!r}")
    return Target(name.strip(), url.strip())


def parse_concurrency(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected e.g. 1,2,4,8, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("concurrencies must be integers >= 1")
    return sorted(set(values))


def tokens_in_window(record: RequestRecord, t0: float, t1: float) -> float:
    """Output tokens of one request generated inside [t0, t1] (epoch seconds).

    The first token lands at TTFT; the rest are spread evenly over the decode span, so a
    request cut by the window's end counts only the part generated inside it.
    """
    if record.error is not None or record.output_tokens <= 0:
        return 0.0
    first = record.start + (record.ttft_s if record.ttft_s is not None else 0.0)
    end = record.start + record.latency_s
    count = 1.0 if t0 <= first <= t1 else 0.0
    rest = record.output_tokens - 1
    if record.ttft_s is None:  # non-streaming: no first-token time, spread everything
        count, rest = 0.0, record.output_tokens
    if rest <= 0:
        return count
    if end <= first:
        return count + (rest if t0 <= end <= t1 else 0.0)
    overlap = max(0.0, min(end, t1) - max(first, t0))
    return count + rest * overlap / (end - first)


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def summarize(
    target: Target, concurrency: int, duration_s: float, records: Sequence[RequestRecord]
) -> Point:
    """One point of the curve; the window starts with the run's first request."""
    ok = [r for r in records if r.error is None]
    t0 = min((r.start for r in records), default=0.0)
    tokens = sum(tokens_in_window(r, t0, t0 + duration_s) for r in ok)
    ttft = _mean([None if r.ttft_s is None else r.ttft_s * 1000 for r in ok])
    tpot = _mean([None if r.tpot_s is None else r.tpot_s * 1000 for r in ok])
    return Point(
        target=target.name,
        url=target.url,
        concurrency=concurrency,
        duration_s=duration_s,
        requests=len(ok),
        failures=len(records) - len(ok),
        output_tokens=sum(r.output_tokens for r in ok),
        throughput_tok_s=tokens / duration_s if duration_s > 0 else 0.0,
        per_user_tok_s=_mean([r.tokens_per_s for r in ok]),
        ttft_ms=ttft,
        tpot_ms=tpot,
        acceptance_length=_mean([r.acceptance_length for r in ok]),
    )


def throughput_at(
    curve: Sequence[Point], interactivity: float
) -> tuple[float | None, EstimateKind]:
    """Total tokens/s on a target's curve at a per-user tokens/s, linearly interpolated.

    Beyond the curve's most interactive point the level is unreachable; below its least
    interactive point (the highest concurrency measured) that point's throughput is a
    lower bound, since more concurrency would trade interactivity for more throughput.
    """
    pts = sorted((p.per_user_tok_s, p.throughput_tok_s) for p in curve if p.per_user_tok_s)
    if not pts or interactivity > pts[-1][0] * (1 + 1e-9):
        return None, "unreachable"
    if interactivity < pts[0][0]:
        return pts[0][1], "lower_bound"
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if x0 <= interactivity <= x1:
            share = 0.0 if x1 == x0 else (interactivity - x0) / (x1 - x0)
            return y0 + share * (y1 - y0), "interpolated"
    return pts[-1][1], "interpolated"  # interactivity equals the only / last point


def default_interactivity(points: Sequence[Point], baseline: str) -> float | None:
    """The baseline's per-user tokens/s at its lowest concurrency (1 in a normal sweep)."""
    curve = [p for p in points if p.target == baseline and p.per_user_tok_s]
    if not curve:
        return None
    return min(curve, key=lambda p: p.concurrency).per_user_tok_s


def compare(points: Sequence[Point], baseline: str, interactivity: float) -> list[Estimate]:
    """Every target's throughput at `interactivity` and its ratio to the baseline's."""
    names = list(dict.fromkeys(p.target for p in points))
    raw = {n: throughput_at([p for p in points if p.target == n], interactivity) for n in names}
    base = raw.get(baseline, (None, "unreachable"))[0]
    estimates = []
    for name in names:
        value, kind = raw[name]
        ratio = value / base if value is not None and base else None
        estimates.append(Estimate(name, value, kind, ratio))
    return estimates


def write_csv(points: Sequence[Point], path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as out:
        writer = csv.DictWriter(out, fieldnames=[f.name for f in fields(Point)])
        writer.writeheader()
        for point in points:
            writer.writerow({k: "" if v is None else v for k, v in asdict(point).items()})


def read_csv(path: Path) -> list[Point]:
    """The inverse of write_csv (used by --replot to recompute without re-running)."""
    types = {"concurrency": int, "requests": int, "failures": int, "output_tokens": int}
    points = []
    with path.open(newline="", encoding="utf-8") as src:
        for row in csv.DictReader(src):
            values: dict[str, object] = {}
            for key, text in row.items():
                if key in ("target", "url"):
                    values[key] = text
                else:
                    values[key] = None if text == "" else types.get(key, float)(text)
            points.append(Point(**values))  # type: ignore[arg-type]
    return points


def write_json(
    points: Sequence[Point],
    baseline: str,
    interactivity: float | None,
    estimates: Sequence[Estimate],
    settings: dict[str, object],
    path: Path,
) -> None:
    report = {
        "settings": settings,
        "points": [asdict(p) for p in points],
        "baseline": baseline,
        "interactivity_tok_s": interactivity,
        "at_interactivity": [asdict(e) for e in estimates],
    }
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


def plot(
    points: Sequence[Point],
    interactivity: float | None,
    estimates: Sequence[Estimate],
    path: Path,
    title: str,
) -> None:
    """Total output tokens/s against per-user tokens/s, one curve per target."""
    import matplotlib  # imported here: only the sweep's last step needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    for name in dict.fromkeys(p.target for p in points):
        _draw_curve(ax, [p for p in points if p.target == name and p.per_user_tok_s], name)
    if interactivity is not None:
        ax.axvline(interactivity, color="grey", linestyle=":", linewidth=1)
        for e in estimates:
            if e.throughput_tok_s is not None:
                ax.plot([interactivity], [e.throughput_tok_s], marker="*", color="black")
    ax.set_xlabel("per-user tokens/s (interactivity)")
    ax.set_ylabel("total output tokens/s (throughput)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _draw_curve(ax: Any, curve: list[Point], name: str) -> None:
    """One target's points in concurrency order, each labelled with its concurrency."""
    curve = sorted(curve, key=lambda p: p.concurrency)
    xs = [p.per_user_tok_s or 0.0 for p in curve]
    ax.plot(xs, [p.throughput_tok_s for p in curve], marker="o", label=name)
    for x, p in zip(xs, curve, strict=True):
        ax.annotate(f"c={p.concurrency}", (x, p.throughput_tok_s),
                    textcoords="offset points", xytext=(4, 4), fontsize=7)  # fmt: skip


@dataclass(frozen=True)
class LoadOptions:
    """What every Locust run of the sweep gets (passed through to the locustfile)."""

    duration_s: int
    model: str
    max_tokens: int
    temperature: float
    api_key: str
    prompt_file: Path
    ignore_eos: bool
    stop_timeout_s: int
    locustfile: Path


def locust_command(target: Target, concurrency: int, opts: LoadOptions, run_dir: Path) -> list[str]:
    n = str(concurrency)
    cmd = [
        sys.executable, "-m", "locust", "-f", str(opts.locustfile), "--headless",
        "-u", n, "-r", n, "-t", f"{opts.duration_s}s", "--host", target.url,
        "--stop-timeout", str(opts.stop_timeout_s), "--only-summary", "--loglevel", "WARNING",
        "--csv", str(run_dir / "locust"), "--records-file", str(run_dir / "records.jsonl"),
        "--max-tokens", str(opts.max_tokens), "--temperature", str(opts.temperature),
        "--prompt-file", str(opts.prompt_file),
    ]  # fmt: skip
    if opts.model:
        cmd += ["--model", opts.model]
    if opts.ignore_eos:
        cmd.append("--ignore-eos")
    return cmd


def run_point(target: Target, concurrency: int, opts: LoadOptions, out_dir: Path) -> Point:
    """One headless Locust run; its CSVs, log and per-request records stay in a run folder."""
    run_dir = out_dir / "runs" / f"{target.name}-c{concurrency}"
    run_dir.mkdir(parents=True, exist_ok=True)
    records_file = run_dir / "records.jsonl"
    records_file.unlink(missing_ok=True)
    env = dict(os.environ)
    if opts.api_key:  # by env, not argv, so it does not show in ps
        env["DFLASH_API_KEY"] = opts.api_key
    cmd = locust_command(target, concurrency, opts, run_dir)
    with (run_dir / "locust.log").open("w", encoding="utf-8") as log:
        done = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False,
            timeout=opts.duration_s + opts.stop_timeout_s + 120,
        )  # fmt: skip
    if done.returncode != 0:
        print(f"  locust exited {done.returncode}; see {run_dir / 'locust.log'}", file=sys.stderr)
    records = []
    if records_file.exists():
        lines = records_file.read_text(encoding="utf-8").splitlines()
        records = [RequestRecord.from_json(line) for line in lines if line.strip()]
    return summarize(target, concurrency, float(opts.duration_s), records)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(points: Sequence[Point]) -> str:
    head = f"{'target':<12}{'conc':>5}{'reqs':>6}{'fail':>5}{'out tok/s':>11}"
    head += f"{'user tok/s':>12}{'TTFT ms':>9}{'TPOT ms':>9}{'accept':>8}"
    rows = [head]
    for p in points:
        row = f"{p.target:<12}{p.concurrency:>5}{p.requests:>6}{p.failures:>5}"
        row += f"{p.throughput_tok_s:>11.1f}{_fmt(p.per_user_tok_s):>12}{_fmt(p.ttft_ms, 0):>9}"
        row += f"{_fmt(p.tpot_ms):>9}{_fmt(p.acceptance_length, 2):>8}"
        rows.append(row)
    return "\n".join(rows)


def format_comparison(
    baseline: str, interactivity: float | None, estimates: Sequence[Estimate]
) -> str:
    if interactivity is None:
        return f"no interactivity level: {baseline!r} has no point with per-user tokens/s"
    lines = [f"at {interactivity:.1f} tokens/s per user (baseline: {baseline}):"]
    for e in estimates:
        if e.throughput_tok_s is None:
            lines.append(f"  {e.target:<12} unreachable (its curve never gets that interactive)")
            continue
        bound = ">= " if e.kind == "lower_bound" else ""
        ratio = "" if e.ratio is None else f"  {bound}{e.ratio:.2f}x {baseline}"
        lines.append(f"  {e.target:<12} {bound}{e.throughput_tok_s:.1f} tokens/s ({e.kind}){ratio}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-bench sweep",
        description="Throughput at fixed interactivity: Locust over concurrencies, per target.",
    )
    add = parser.add_argument
    add(
        "--target",
        type=parse_target,
        action="append",
        default=[],
        metavar="NAME=URL",
        help="OpenAI-compatible base URL to load (repeat; e.g. plain=http://127.0.0.1:8100)",
    )
    add("--concurrency", type=parse_concurrency, default=[1, 2, 4, 8], metavar="N,N,...")
    add("--duration", type=int, default=30, help="seconds of load per point")
    add("--baseline", default="", help="target the ratios are relative to (default: first)")
    add(
        "--interactivity",
        type=float,
        default=None,
        help="per-user tokens/s to compare at (default: baseline at its lowest concurrency)",
    )
    add("--out-dir", type=Path, default=Path("sweep-results"))
    add("--model", default="", help="default: the first of each target's GET /v1/models")
    add("--max-tokens", type=int, default=128)
    add("--temperature", type=float, default=0.0)
    add("--api-key", default=os.environ.get("DFLASH_API_KEY", ""))
    add("--prompt-file", type=Path, default=DEFAULT_PROMPTS)
    add("--ignore-eos", action="store_true", help="every request generates --max-tokens")
    add(
        "--stop-timeout",
        type=int,
        default=60,
        help="seconds a user may take to finish its request after --duration",
    )
    add("--locustfile", type=Path, default=LOCUSTFILE)
    add("--title", default="Throughput at fixed interactivity")
    add(
        "--replot",
        action="store_true",
        help="do not run Locust: recompute and redraw from --out-dir/sweep.csv",
    )
    return parser  # fmt: skip


def _options(args: argparse.Namespace) -> LoadOptions:
    return LoadOptions(
        duration_s=args.duration, model=args.model, max_tokens=args.max_tokens,
        temperature=args.temperature, api_key=args.api_key, prompt_file=args.prompt_file,
        ignore_eos=args.ignore_eos, stop_timeout_s=args.stop_timeout, locustfile=args.locustfile,
    )  # fmt: skip


def _measure(args: argparse.Namespace) -> list[Point]:
    opts, points = _options(args), []
    for target in args.target:
        for concurrency in args.concurrency:
            print(f"{target.name} c={concurrency}: {args.duration}s of load on {target.url}",
                  flush=True)  # fmt: skip
            points.append(run_point(target, concurrency, opts, args.out_dir))
    return points


def _settings(args: argparse.Namespace) -> dict[str, object]:
    previous = args.out_dir / "sweep.json"
    if args.replot and previous.exists():  # the run's settings, not the replot's flags
        loaded: dict[str, object] = json.loads(previous.read_text(encoding="utf-8"))["settings"]
        return loaded
    keep = ("concurrency", "duration", "model", "max_tokens", "temperature", "ignore_eos")
    settings: dict[str, object] = {k: getattr(args, k) for k in keep}
    settings["targets"] = {t.name: t.url for t in args.target}
    settings["prompt_file"] = str(args.prompt_file)
    return settings


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.target and not args.replot:
        build_parser().error("at least one --target NAME=URL is needed")
    if len({t.name for t in args.target}) != len(args.target):
        build_parser().error("target names must be distinct")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = args.out_dir / "sweep.csv"
    points = read_csv(csv_path) if args.replot else _measure(args)
    names = list(dict.fromkeys(p.target for p in points))
    baseline = args.baseline or (names[0] if names else "")
    if baseline not in names:
        build_parser().error(f"--baseline {baseline!r} is not one of the targets {names}")
    level = args.interactivity or default_interactivity(points, baseline)
    estimates = compare(points, baseline, level) if level else []
    write_csv(points, csv_path)
    write_json(points, baseline, level, estimates, _settings(args), args.out_dir / "sweep.json")
    plot(points, level, estimates, args.out_dir / "sweep.png", args.title)
    print(format_table(points))
    print(format_comparison(baseline, level, estimates))
    print(f"wrote {csv_path}, sweep.json and sweep.png in {args.out_dir}")
    return 0 if points and all(p.requests > 0 for p in points) else 1
