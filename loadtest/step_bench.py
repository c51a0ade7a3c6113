"""`dflash-bench step`: what one speculative step costs, phase by phase.

For every batch size it prefills that many held-out prompts, then runs steps of plain
decoding (target alone, no drafter: the unit) and of DFlash verifying w - 1 drafts for
every requested block width w, interleaved (plain, w=4, w=8, w=16, plain, ...), so a
noisy machine hits every column alike. Each step is split into the phases `spec_step`
times itself (prepare, draft, verify, accept, context, commit); "other" is the rest of
the call. Costs are reported in milliseconds (median thread CPU time per step; wall
time percentiles beside it show the noise; on a GPU the median wall time, each phase
waiting for its kernels) and in plain-step units, with
the tokens each step commits and the resulting speedup bound (tokens per step / cost in
plain steps). Rows advance through real greedy decoding and restart from their prompt
after `--run-tokens` tokens (same context range for every column).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence as Seq
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.harness import BUNDLED, bench_prompts, int_list, percentile
from loadtest.step_parts import PARTS, timing_parts

PHASES = ("prepare", "draft", "verify", "accept", "context", "commit")


@dataclass
class Column:
    """One (batch size, width) cell: width 1 is plain decoding without a drafter."""

    batch_size: int
    width: int
    drafter: bool  # False: the target alone (the unit); True: through the DFlash state
    wall: bool = False  # cost from wall time (a GPU: the host waits, its CPU time is no cost)
    step_ms: list[float] = field(default_factory=list)  # wall time of each spec_step call
    cpu_ms: list[float] = field(default_factory=list)  # thread CPU time of each call
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    part_s: dict[str, float] = field(default_factory=dict)  # --parts: DFlash2's own parts
    steps: int = 0
    tokens: int = 0  # committed tokens, all rows

    def summary(self, plain: Column) -> dict[str, Any]:
        # Costs from thread CPU time: preemption by other processes on a shared machine
        # inflates wall time at random; CPU time is steadier (wall is kept alongside).
        # On a GPU the step's time is the device's, which only wall time holds.
        median = statistics.median(self.step_ms if self.wall else self.cpu_ms)
        unit = statistics.median(plain.step_ms if plain.wall else plain.cpu_ms)
        total_phase = sum(self.phase_s.values())
        wall = sum(self.step_ms) / 1000.0  # phases are wall-clock shares of the step
        # each phase's share of the median step, from the phases' share of all the time
        phases = {p: median * s / wall for p, s in self.phase_s.items()} if wall else {}
        phases["other"] = median * max(0.0, 1.0 - total_phase / wall) if wall else 0.0
        parts = {p: median * s / wall for p, s in self.part_s.items()} if wall else {}
        tokens_per_step = self.tokens / (self.steps * self.batch_size) if self.steps else 0.0
        cost = median / unit if unit else 0.0
        return {
            "batch_size": self.batch_size,
            "width": self.width,
            "num_draft": self.width - 1,
            "drafter": self.drafter,
            "steps": self.steps,
            "step_ms_median": statistics.median(self.step_ms),
            "step_ms_p10": percentile(self.step_ms, 10),
            "step_ms_p90": percentile(self.step_ms, 90),
            "cpu_ms_median": statistics.median(self.cpu_ms),
            "cost_basis": "wall" if self.wall else "cpu",
            "cost_ms_median": median,
            "phases_ms": phases,
            "cost_plain_steps": cost,
            "phases_plain_steps": {p: v / unit for p, v in phases.items()} if unit else {},
            # --parts: shares of the step inside the draft phase (DFlash2's conv, selector)
            "parts_plain_steps": {p: v / unit for p, v in parts.items()} if unit else {},
            "tokens_per_row_step": tokens_per_step,
            "speedup_bound": tokens_per_step / cost if cost else 0.0,
        }


def parse_args(argv: Seq[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dflash-bench step", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=BUNDLED / "target", help="target folder")
    p.add_argument("--drafter", type=Path, default=BUNDLED / "dflash", help="DFlash folder")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 8])
    p.add_argument(
        "--block-sizes",
        type=int_list,
        default=[4, 8, 16],
        help="verify widths w (w - 1 drafts), at most the drafter's block size",
    )
    p.add_argument("--steps", type=int, default=60, help="timed steps per cell and round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.add_argument(
        "--run-tokens",
        type=int,
        default=96,
        help="rows restart from their prompt after generating this many tokens",
    )
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length (truncated)")
    p.add_argument("--prompts", type=Path, default=None, help="JSON list or JSONL of prompts")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (0 = the CPUs this process may use)",
    )
    p.add_argument(
        "--background-load",
        action="store_true",
        help="also measure with one core kept busy by another process",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--drafter-dtype",
        default=None,
        help="drafter compute dtype (default: --dtype), or int8 (float activations, int8 "
        "matmuls: EngineConfig.drafter_int8); drafts only propose, so a different one keeps "
        "greedy outputs exact",
    )
    p.add_argument(
        "--parts",
        action="store_true",
        help="also time a DFlash2 drafter's convolution and candidate selector (inside draft)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p.parse_args(list(argv))


def main(argv: Seq[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    for name, folder in (("target", args.model), ("drafter", args.drafter)):
        if not (folder / "config.json").is_file():
            print(f"dflash-bench step: no {name} checkpoint at {folder}", file=sys.stderr)
            return 2
    from engine.threads import BusyCore, configure_torch_threads

    threads = configure_torch_threads(args.threads or None)
    setups = [("quiet", False)] + ([("loaded", True)] if args.background_load else [])
    report: dict[str, Any] = {"benchmark": "step", "threads": threads, "runs": {}}
    bench = StepBench(args)
    for name, loaded in setups:
        if loaded:
            with BusyCore(seconds=600.0):
                report["runs"][name] = bench.run()
        else:
            report["runs"][name] = bench.run()
    report.update(bench.describe())
    print(format_table(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


def format_table(report: dict[str, Any]) -> str:
    basis = "wall" if report.get("device", "cpu").startswith("cuda") else "thread CPU"
    head = (
        f"{'batch':>5} {'w':>3} {'ms':>7} {'wall p10-p90':>12} {'plain':>6} "
        + " ".join(f"{p[:7]:>7}" for p in (*PHASES, "other"))
        + f" {'tok/step':>8} {'bound':>6}"
        + ("".join(f" {p[:8]:>8}" for p in PARTS) if report.get("parts") else "")
    )
    lines = [
        f"step benchmark: {report['model']} + {report['drafter']} "
        f"(threads {report['threads']}; ms = median {basis} ms per step; phases in "
        f"plain-step units; bound = "
        f"tokens per step / cost; w 1d = 0 drafts through the DFlash state)"
    ]
    for name, run in report["runs"].items():
        lines += [f"[{name}]", head, "-" * len(head)]
        for r in run["columns"]:
            ph = r["phases_plain_steps"]
            width = f"{r['width']}{'d' if r['drafter'] and r['width'] == 1 else ''}"
            lines.append(
                f"{r['batch_size']:>5} {width:>3} {r['cost_ms_median']:>7.2f} "
                f"{r['step_ms_p10']:>6.1f}-{r['step_ms_p90']:<5.1f} "
                f"{r['cost_plain_steps']:>6.2f} "
                + " ".join(f"{ph.get(p, 0.0):>7.2f}" for p in (*PHASES, "other"))
                + f" {r['tokens_per_row_step']:>8.2f} {r['speedup_bound']:>5.2f}x"
                + (
                    "".join(f" {r['parts_plain_steps'].get(p, 0.0):>8.2f}" for p in PARTS)
                    if report.get("parts")
                    else ""
                )
            )
    return "\n".join(lines)


class StepBench:
    """Loaded models and one state per (batch size, width): plain or DFlash."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from engine.loader import load_drafter, load_target
        from engine.tokenizer import Tokenizer

        self.args = args
        self.dtype = getattr(torch, args.dtype)
        self.device = args.device
        self.target = load_target(args.model, self.device, self.dtype)
        int8 = args.drafter_dtype == "int8"
        drafter_dtype = self.dtype if int8 else getattr(torch, args.drafter_dtype or args.dtype)
        self.drafter = load_drafter(args.drafter, self.target, self.device, drafter_dtype)
        if int8:
            self.drafter.use_int8()
        tokenizer = Tokenizer.from_dir(args.model)
        texts = bench_prompts(args.prompts, max(args.batch_sizes))
        self.prompts = [tokenizer.encode(t)[-args.prompt_tokens :] for t in texts]
        widths = [w for w in args.block_sizes if 1 < w <= self.drafter.block_size]
        self.widths = [1, *sorted(set(widths))]
        # (width, through the DFlash state): plain, then k = 0 with the drafter, then w - 1
        self.variants = [(1, False), (1, True), *((w, True) for w in self.widths[1:])]

    def describe(self) -> dict[str, Any]:
        return {
            "model": str(self.args.model),
            "drafter": str(self.args.drafter),
            "device": self.device,
            "dtype": self.args.dtype,
            "drafter_dtype": self.args.drafter_dtype or self.args.dtype,
            "widths": self.widths,
            "batch_sizes": list(self.args.batch_sizes),
            "prompt_tokens": self.args.prompt_tokens,
            "parts": self.args.parts,
        }

    def run(self) -> dict[str, Any]:
        columns = []
        for b in self.args.batch_sizes:
            wall = self.device.startswith("cuda")
            cells = {v: Column(b, *v, wall=wall) for v in self.variants}
            states = {v: self._state(b, v[1]) for v in self.variants}
            rows = {v: self._restart(states[v], b) for v in self.variants}
            for v in self.variants:  # warm-up: first-call allocations and fused weights
                rows[v] = self._advance(states[v], rows[v], v[0], None)
            for _ in range(self.args.rounds):
                for v in self.variants:
                    rows[v] = self._measure(states[v], rows[v], v[0], cells[v])
            columns += [cells[v].summary(cells[(1, False)]) for v in self.variants]
        return {"columns": columns}

    def _state(self, batch: int, drafter: bool) -> Any:
        from engine.speculative import SpecState

        size = self.drafter.block_size if drafter else 1
        capacity = max(map(len, self.prompts)) + self.args.run_tokens + 2 * size
        return SpecState.create(
            self.target,
            self.drafter if drafter else None,
            batch,
            capacity,
            size,
            self.device,
            self.dtype,
        )

    def _restart(self, state: Any, batch: int) -> list[Any]:
        from engine.speculative import DecodeRow, PrefillRow, RowSampling, prefill, release

        greedy = RowSampling(temperature=0.0)
        prompts = [self.prompts[i % len(self.prompts)] for i in range(batch)]
        for slot in range(batch):
            release(state, slot)
        firsts = prefill(state, [PrefillRow(i, p) for i, p in enumerate(prompts)], [greedy] * batch)
        return [DecodeRow(i, firsts[i].token_ids[0], len(p)) for i, p in enumerate(prompts)]

    def _advance(
        self, state: Any, rows: list[Any], width: int, cell: Column | None, count: int = 3
    ) -> list[Any]:
        from engine.speculative import DecodeRow, RowSampling, StepTimings, spec_step, synchronize

        greedy = [RowSampling(temperature=0.0)] * len(rows)
        k = width - 1
        for _ in range(count):
            if any(
                r.position - len(self.prompts[r.slot % len(self.prompts)]) >= self.args.run_tokens
                for r in rows
            ):
                rows = self._restart(state, len(rows))
            timings = StepTimings()
            parts: dict[str, float] = {}
            timed = self.args.parts and cell is not None
            synchronize(state)  # on a GPU: the last step's kernels are not this one's
            wall, cpu = time.perf_counter(), time.thread_time()
            with timing_parts(parts, self.device.startswith("cuda")) if timed else nullcontext():
                results = spec_step(state, rows, greedy, num_draft=k, timings=timings)
            synchronize(state)
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            if cell is not None:
                cell.step_ms.append(wall * 1000.0)
                cell.cpu_ms.append(cpu * 1000.0)
                for p in PHASES:
                    cell.phase_s[p] += getattr(timings, p)
                for p, seconds in parts.items():
                    cell.part_s[p] = cell.part_s.get(p, 0.0) + seconds
                cell.steps += 1
                cell.tokens += sum(len(r.token_ids) for r in results)
            rows = [
                DecodeRow(r.slot, res.token_ids[-1], r.position + len(res.token_ids))
                for r, res in zip(rows, results, strict=True)
            ]
        return rows

    def _measure(self, state: Any, rows: list[Any], width: int, cell: Column) -> list[Any]:
        return self._advance(state, rows, width, cell, self.args.steps)
