"""`dflash-bench gpu` (`make gpu-bench`): the embedded engine on a GPU, in one command.

The bundled tiny-coder target and its DFlash drafter: DFlash (every step the drafter's full
block, and adaptive k per step as `dflash-worker` serves it) against plain at c = 1..32 for
two request shapes (all greedy; greedy and temperature 1.0 interleaved, every other sampled
one seeded) through `dflash-bench engine`'s functions, then one step's cost by phase
through `dflash-bench step`'s. Prints one table (DFlash/plain tokens/s per shape and
concurrency, acceptance length, the step profile's summary) and writes JSON with the
device's name, torch's version, the dtype and the commit. bfloat16 on CUDA unless --dtype
says otherwise, float32 on a CPU. Sized to finish in a few minutes on one GPU; `--quick`
(c = 1,2, few prompts, few tokens) runs on a CPU in seconds, so CI keeps the command alive.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from loadtest import engine_bench, step_bench
from loadtest.harness import BUNDLED, aligned, bench_prompts, git_commit, int_list

SHAPES = engine_bench.MIXES  # greedy, mixed
DEFAULT_JSON = Path("bench-results/gpu-bench.json")
# Unset sizes, (full run, --quick). The full run is budgeted for an H100 in well under 8
# minutes: the tiny model's steps cost mostly Python and kernel launches, not the GPU.
SIZES: dict[str, tuple[Any, Any]] = {
    "concurrency": ([1, 2, 4, 8, 16, 32], [1, 2]),
    "max_tokens": (64, 8),
    "num_prompts": (8, 4),  # --quick: four, so that the mixed shape has a seeded request
    "repeats": (2, 1),
    "step_batch_sizes": ([1, 8, 32], [1, 2]),
    "step_widths": ([4, 8, 16], [16]),
    "steps": (30, 3),
    "rounds": (2, 1),
}


def parse_args(argv: Seq[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dflash-bench gpu", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a CPU-sized smoke run (CI)")
    p.add_argument("--model", type=Path, default=BUNDLED / "target", help="target folder")
    p.add_argument("--drafter", type=Path, default=BUNDLED / "dflash", help="DFlash folder")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on a CPU")
    p.add_argument("--concurrency", type=int_list, default=None, help="default 1,2,4,8,16,32")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per request")
    p.add_argument("--num-prompts", type=int, default=None, help="held-out prompts")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds per cell")
    p.add_argument("--shapes", default=",".join(SHAPES), help="greedy, mixed or both")
    p.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also DFlash with adaptive k per step, what dflash-worker serves (default on)",
    )
    p.add_argument(
        "--forced-plain",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the adaptive DFlash engine forced plain (what a DFlash engine that does "
        "not draft costs) and a second plain engine, the A/A control (default on)",
    )
    p.add_argument("--step-batch-sizes", type=int_list, default=None, help="step profile")
    p.add_argument("--step-widths", type=int_list, default=None, help="step profile widths")
    p.add_argument("--steps", type=int, default=None, help="timed steps per step cell")
    p.add_argument("--rounds", type=int, default=None, help="step profile rounds")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--commit", default=None, help="the commit measured (default: git's)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="write the results here")
    args = p.parse_args(list(argv))
    for name, sizes in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, sizes[1] if args.quick else sizes[0])
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if not args.shapes or set(args.shapes) - set(SHAPES):
        p.error(f"--shapes: a comma-separated subset of {','.join(SHAPES)}")
    return args


def main(argv: Seq[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    for name, folder in (("target", args.model), ("drafter", args.drafter)):
        if not (folder / "config.json").is_file():
            print(f"dflash-bench gpu: no {name} checkpoint at {folder}", file=sys.stderr)
            return 2
    error = resolve_device(args)
    if error:
        print(f"dflash-bench gpu: {error}", file=sys.stderr)
        return 2
    report = run(args)
    print(format_table(report))
    print(f"wrote {args.json}")
    return 0


def resolve_device(args: argparse.Namespace) -> str | None:
    """Fill in --device (cuda when there is one) and --dtype (bfloat16 on CUDA, float32 on
    a CPU); the reason it cannot run, if any."""
    import torch

    cuda = torch.cuda.is_available()
    args.device = args.device or ("cuda" if cuda else "cpu")
    if args.device.startswith("cuda") and not cuda:
        return f"--device {args.device}, but torch {torch.__version__} sees no CUDA device"
    args.dtype_defaulted = args.dtype is None
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    return None


def machine(device: str) -> dict[str, Any]:
    """What ran it: the device's name, torch's and CUDA's versions, the Python."""
    import torch

    cuda = device.startswith("cuda")
    return {
        "device": device,
        "device_name": torch.cuda.get_device_name(device) if cuda else cpu_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def cpu_name() -> str:
    """The CPU's model name (Linux), else what `platform` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "cpu"


def engine_argv(args: argparse.Namespace, shape: str) -> list[str]:
    """`dflash-bench engine`'s options for one shape of this run."""
    argv = [
        *("--model", str(args.model), "--drafter", str(args.drafter)),
        *("--concurrency", ",".join(map(str, args.concurrency)), "--mix", shape),
        *("--max-tokens", str(args.max_tokens), "--num-prompts", str(args.num_prompts)),
        *("--repeats", str(args.repeats), "--threads", str(args.threads)),
        *("--device", args.device, "--dtype", args.dtype),
    ]
    if args.adaptive:
        argv.append("--adaptive")
    if args.forced_plain:
        argv.append("--forced-plain")
    return argv


def step_argv(args: argparse.Namespace) -> list[str]:
    """`dflash-bench step`'s options for this run's step profile."""
    return [
        *("--model", str(args.model), "--drafter", str(args.drafter)),
        *("--batch-sizes", ",".join(map(str, args.step_batch_sizes))),
        *("--block-sizes", ",".join(map(str, args.step_widths))),
        *("--steps", str(args.steps), "--rounds", str(args.rounds)),
        *("--run-tokens", str(max(8, args.max_tokens)), "--threads", str(args.threads)),
        *("--device", args.device, "--dtype", args.dtype),
    ]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both shapes, then the step profile; the JSON is rewritten after each part (marked
    `complete: false` until the end), so a run cut short still leaves what it measured."""
    start = time.perf_counter()
    report = header(args)
    prompts = bench_prompts(None, args.num_prompts)
    for shape in args.shapes:
        t0 = time.perf_counter()
        engine_args = engine_bench.parse_args(engine_argv(args, shape))
        result = engine_bench.run_benchmark(engine_args, prompts)
        result["elapsed_s"] = time.perf_counter() - t0
        report["shapes"][shape] = result
        report["speedup"] = speedup_rows(report["shapes"])
        save(args.json, report, f"{shape} shape", result["elapsed_s"])
    t0 = time.perf_counter()
    step = run_step(step_bench.parse_args(step_argv(args)))
    step["elapsed_s"] = time.perf_counter() - t0
    report.update(step=step, step_summary=step_rows(step))
    report.update(complete=True, elapsed_s=time.perf_counter() - start)
    save(args.json, report, "step profile", step["elapsed_s"])
    return report


def header(args: argparse.Namespace) -> dict[str, Any]:
    """What the report measured: the machine, the dtype, the commit, the pair, the sizes."""
    return {
        "benchmark": "gpu",
        **machine(args.device),
        "dtype": args.dtype,
        "dtype_defaulted": args.dtype_defaulted,
        "commit": args.commit or git_commit(),
        "quick": args.quick,
        "model": str(args.model),
        "drafter": str(args.drafter),
        "block_size": engine_bench.drafter_block_size(args.drafter),
        "adaptive": args.adaptive,
        "forced_plain": args.forced_plain,
        "sizes": {name: getattr(args, name) for name in SIZES},
        "complete": False,
        "speedup": [],
        "step_summary": [],
        "shapes": {},
        "step": None,
        "elapsed_s": None,
    }


def save(path: Path, report: dict[str, Any], part: str, seconds: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"dflash-bench gpu: {part} done in {seconds:.0f} s", file=sys.stderr, flush=True)


def run_step(args: argparse.Namespace) -> dict[str, Any]:
    """`dflash-bench step`'s quiet run, as its JSON has it."""
    from engine.threads import configure_torch_threads

    threads = configure_torch_threads(args.threads or None)
    bench = step_bench.StepBench(args)
    return {
        "benchmark": "step",
        "threads": threads,
        "runs": {"quiet": bench.run()},
        **bench.describe(),
    }


def speedup_rows(shapes: dict[str, Any]) -> list[dict[str, Any]]:
    """Per shape and concurrency: plain and DFlash tokens/s, their ratio (totals and the
    median of back-to-back pairs) and DFlash's acceptance length; adaptive's, forced
    plain's and the A/A control's beside."""
    rows = []
    for shape, report in shapes.items():
        for c in report["concurrency"]:
            cells = [r for r in report["results"] if r["concurrency"] == c]
            plain = next(r for r in cells if r["block_size"] == 1)
            for r in cells:
                if (r["block_size"] == 1 and not r["control"]) or r["drafter_int8"]:
                    continue
                rows.append(
                    {
                        "shape": shape,
                        "concurrency": c,
                        "variant": variant_name(r),
                        "plain_tokens_per_second": plain["tokens_per_second"],
                        "dflash_tokens_per_second": r["tokens_per_second"],
                        "ratio": r["speedup_vs_block_size_1"],
                        "median_paired_ratio": r["median_paired_speedup"],
                        "acceptance_length": r["mean_acceptance_length"],
                        "draft_tokens_per_step": r["mean_draft_tokens_per_step"],
                    }
                )
    return rows


def variant_name(cell: dict[str, Any]) -> str:
    """A row's engine: DFlash at its full block, adaptive, adaptive forced plain, or the
    second plain engine (the A/A control: its ratio is the run's resolution)."""
    if cell["control"]:
        return "plain A/A"
    if cell["forced_plain"]:
        return "forced plain"
    return "adaptive" if cell["adaptive"] else "dflash"


def step_rows(step: dict[str, Any]) -> list[dict[str, Any]]:
    """The step profile in brief: per batch size and width, the step's cost in plain steps,
    its largest phases, tokens per step and the speedup bound they give."""
    rows = []
    for col in step["runs"]["quiet"]["columns"]:
        if not col["drafter"] or col["width"] == 1:
            continue
        plain = next(
            c
            for c in step["runs"]["quiet"]["columns"]
            if c["batch_size"] == col["batch_size"] and not c["drafter"]
        )
        phases = col["phases_plain_steps"]
        rows.append(
            {
                "batch_size": col["batch_size"],
                "width": col["width"],
                "plain_ms": plain["cost_ms_median"],
                "step_ms": col["cost_ms_median"],
                "cost_plain_steps": col["cost_plain_steps"],
                "draft": phases.get("draft", 0.0),
                "verify": phases.get("verify", 0.0),
                "rest": sum(v for p, v in phases.items() if p not in ("draft", "verify")),
                "tokens_per_row_step": col["tokens_per_row_step"],
                "speedup_bound": col["speedup_bound"],
            }
        )
    return rows


def format_table(report: dict[str, Any]) -> str:
    where = "CUDA" if report["device"].startswith("cuda") else "CPU"
    dtype = report["dtype"] + (f" (the {where} default)" if report["dtype_defaulted"] else "")
    lines = [
        f"gpu bench: {report['device_name']} ({report['device']}), torch {report['torch']}, "
        f"{dtype}, commit {(report['commit'] or 'unknown')[:12]}",
        f"{Path(report['model']).name} + {Path(report['drafter']).name} (block "
        f"{report['block_size']}); max_tokens {report['sizes']['max_tokens']}, "
        f"{report['sizes']['num_prompts']} prompts, repeats {report['sizes']['repeats']}",
        "",
    ]
    head = [
        "shape",
        "conc",
        "variant",
        "plain tok/s",
        "dflash tok/s",
        "ratio",
        "median",
        "accept len",
    ]
    rows = [head] + [
        [
            r["shape"],
            str(r["concurrency"]),
            r["variant"],
            f"{r['plain_tokens_per_second']:.1f}",
            f"{r['dflash_tokens_per_second']:.1f}",
            _x(r["ratio"]),
            _x(r["median_paired_ratio"]),
            f"{r['acceptance_length']:.2f}",
        ]
        for r in report["speedup"]
    ]
    lines.append(aligned(rows))
    matches = [
        f"{shape} shape {s['outputs_match']} "
        f"({s['greedy_requests_matched']}/{s['greedy_requests_compared']} requests)"
        for shape, s in report["shapes"].items()
    ]
    lines.append("greedy outputs identical, DFlash vs plain: " + ", ".join(matches))
    seeded = [
        f"{shape} shape {s['seeded_requests_matched']}/{s['seeded_requests_compared']} requests"
        for shape, s in report["shapes"].items()
        if s.get("seeded_requests_compared")
    ]
    if seeded:
        lines.append("seeded sampled outputs identical, DFlash vs plain: " + ", ".join(seeded))
    lines += ["", "step profile (cost in plain steps; ms = median per step):"]
    head = [
        "batch",
        "width",
        "plain ms",
        "step ms",
        "cost",
        "draft",
        "verify",
        "rest",
        "tok/step",
        "bound",
    ]
    rows = [head] + [
        [
            str(r["batch_size"]),
            str(r["width"]),
            f"{r['plain_ms']:.2f}",
            f"{r['step_ms']:.2f}",
            f"{r['cost_plain_steps']:.2f}",
            f"{r['draft']:.2f}",
            f"{r['verify']:.2f}",
            f"{r['rest']:.2f}",
            f"{r['tokens_per_row_step']:.2f}",
            _x(r["speedup_bound"]),
        ]
        for r in report["step_summary"]
    ]
    lines += [aligned(rows), "", f"took {report['elapsed_s']:.0f} s"]
    return "\n".join(lines)


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"
