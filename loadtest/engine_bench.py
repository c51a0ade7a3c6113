"""`dflash-bench engine`: the embedded engine's decoding speed, DFlash against plain.

For every concurrency and every block size (1 = plain decoding, and the drafter's) it runs
the same requests through the engine directly (no HTTP), greedy or (`--mix mixed`) greedy
and sampled interleaved, and reports generated tokens/s, the mean acceptance length, and the
speedup over block size 1 at the same concurrency. One engine per block size stays loaded
and the repeats are interleaved (plain, DFlash, plain, DFlash, ...; each round starts one
variant further on) so a noisy machine affects both sides alike. Greedy outputs must be
identical across block sizes; the JSON says whether they were (sampled ones are compared
with nothing). `--forced-plain` adds a DFlash engine whose planner never drafts (it plans
plain by its own rules), and a second plain engine as the A/A control.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from loadtest.harness import BUNDLED, bench_prompts, int_list, round_order

MIXES = ("greedy", "mixed")
SAMPLED = 1.0  # the mixed shape's other half (as speedup_matrix's): drafts rarely accepted


@dataclass
class Cell:
    """One (concurrency, block size) pair, summed over its repeats."""

    concurrency: int
    block_size: int
    adaptive: bool = False  # k chosen per step by engine.adaptive (block_size = its max)
    drafter_int8: bool = False  # the drafter's matmuls in int8 (EngineConfig.drafter_int8)
    forced_plain: bool = False  # adaptive DFlash whose planner plans, then never drafts
    control: bool = False  # a second plain engine: the A/A resolution of the ratios
    generated_tokens: int = 0
    elapsed_s: float = 0.0
    num_requests: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    runs_tokens_per_second: list[float] = field(default_factory=list)
    forward_s: float = 0.0  # of elapsed_s, in the runner's forwards (its StepProfile)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def to_json(self, baseline: Cell | None) -> dict[str, Any]:
        out = asdict(self)
        out["tokens_per_second"] = self.tokens_per_second
        # What the engine spends around its forwards (scheduling, planning, reading results)
        # a generated token: where a DFlash worker that does not draft differs from a plain one.
        out["host_ms_per_token"] = (
            (self.elapsed_s - self.forward_s) / self.generated_tokens * 1e3
            if self.generated_tokens
            else None
        )
        out["mean_acceptance_length"] = self.mean_acceptance_length
        out["mean_draft_tokens_per_step"] = (
            self.num_draft_tokens / self.num_drafts if self.num_drafts else 0.0
        )
        out["draft_acceptance_rate"] = (
            self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None
        )
        base = baseline.tokens_per_second if baseline is not None else 0.0
        out["speedup_vs_block_size_1"] = self.tokens_per_second / base if base > 0 else None
        out["paired_speedups"] = self.paired_speedups(baseline)
        paired = out["paired_speedups"]
        out["median_paired_speedup"] = statistics.median(paired) if paired else None
        return out

    def paired_speedups(self, baseline: Cell | None) -> list[float]:
        """Run r against the baseline's run r: they ran back to back, so on a noisy
        machine these ratios (and their median) are steadier than the totals' ratio."""
        if baseline is None:
            return []
        pairs = zip(self.runs_tokens_per_second, baseline.runs_tokens_per_second, strict=True)
        return [mine / base for mine, base in pairs if base > 0]


def parse_args(argv: Seq[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dflash-bench engine", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=BUNDLED / "target", help="target folder")
    p.add_argument("--drafter", type=Path, default=BUNDLED / "dflash", help="DFlash folder")
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 8])
    p.add_argument(
        "--block-sizes",
        type=int_list,
        default=None,
        help="block sizes to compare (default: 1 and the drafter's)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument(
        "--mix",
        choices=MIXES,
        default="greedy",
        help="greedy: every request at temperature 0; mixed: even requests greedy, odd ones "
        f"at temperature {SAMPLED}, every other of those with a seed",
    )
    p.add_argument("--prompts", type=Path, default=None, help="JSON list or JSONL of prompts")
    p.add_argument("--num-prompts", type=int, default=8, help="held-out prompts to use")
    p.add_argument(
        "--requests-per-slot",
        type=int,
        default=2,
        help="requests per round = concurrency x this (at least the prompts)",
    )
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds per cell")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (0 = the CPUs this process may use: affinity and "
        "cgroup quota); 1 suits small models, whose matmuls are too small to split and "
        "whose spare threads only spin",
    )
    p.add_argument(
        "--adaptive",
        action="store_true",
        help="also run DFlash with the adaptive policy (k per step from a start-up cost "
        "model and live acceptance; engine.adaptive), at the drafter's block size",
    )
    p.add_argument(
        "--drafter-int8",
        action="store_true",
        help="also run DFlash (and adaptive, with --adaptive) with the drafter's matmuls in "
        "int8 (EngineConfig.drafter_int8)",
    )
    p.add_argument(
        "--forced-plain",
        action="store_true",
        help="also run the adaptive DFlash engine with its planner forced plain (it finds "
        "no plan worth drafting and plans plain by its own rules: what a DFlash worker that "
        "does not draft costs) and a second plain engine (the A/A control), both against "
        "plain",
    )
    p.add_argument(
        "--background-load",
        action="store_true",
        help="run everything twice: quiet, then with one core kept busy by another process",
    )
    p.add_argument(
        "--peak-rss",
        action="store_true",
        help="also measure peak RSS of one DFlash engine serving 16 sequences at 2048 "
        "context (a child process)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p.parse_args(list(argv))


def main(argv: Seq[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    for name, folder in (("target", args.model), ("drafter", args.drafter)):
        if not (folder / "config.json").is_file():
            print(
                f"dflash-bench engine: no {name} checkpoint at {folder} (the bundled "
                f"tiny-coder is built by `make train`; or pass --model/--drafter)",
                file=sys.stderr,
            )
            return 2
    prompts = bench_prompts(args.prompts, args.num_prompts)
    report = run_benchmark(args, prompts)
    print(format_table(report))
    if args.background_load:
        from engine.threads import BusyCore

        with BusyCore(seconds=3600.0):
            loaded = run_benchmark(args, prompts)
        loaded["background_load"] = "one core busy (a spinning child process)"
        print(format_table(loaded, "with one core busy"))
        report["loaded"] = loaded
    if args.peak_rss:
        report["peak_rss"] = measure_peak_rss(args)
        rss = report["peak_rss"]
        print(
            f"peak RSS, DFlash engine with {rss['sequences']} sequences at "
            f"{rss['context']} context: {rss['peak_rss_mb']:.0f} MB"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


def format_table(report: dict[str, Any], title: str = "quiet") -> str:
    head = (
        f"{'conc':>5} {'block':>6} {'tok/s':>9} {'accept len':>10} {'k/step':>6} "
        f"{'speedup':>8} {'median':>7} {'tokens':>7} {'host ms/tok':>11}"
    )
    lines = [
        f"engine benchmark ({title}): {report['model']} + {report['drafter']} "
        f"({report['mix']} requests, max_tokens {report['max_tokens']}, "
        f"repeats {report['repeats']}, threads {report['threads']})",
        head,
        "-" * len(head),
    ]
    for r in report["results"]:
        speedup, median = r["speedup_vs_block_size_1"], r["median_paired_speedup"]
        host = r["host_ms_per_token"]
        block = f"{r['block_size']}" + "".join(
            mark for key, mark in VARIANT_MARKS.items() if r[key]
        )
        lines.append(
            f"{r['concurrency']:>5} {block:>6} {r['tokens_per_second']:>9.1f} "
            f"{r['mean_acceptance_length']:>10.2f} {r['mean_draft_tokens_per_step']:>6.2f} "
            f"{'-' if speedup is None else f'{speedup:.2f}x':>8} "
            f"{'-' if median is None else f'{median:.2f}x':>7} {r['generated_tokens']:>7} "
            f"{'-' if host is None else f'{host:.4f}':>11}"
        )
    lines.append(f"greedy outputs identical across block sizes: {report['outputs_match']}")
    lines.append("block marks: " + ", ".join(f"{m} {k}" for k, m in VARIANT_MARKS.items()))
    if report.get("adaptive_costs"):
        lines.append(
            "adaptive: k chosen per batch size at the measured acceptance: "
            + str(report["adaptive_table"])
        )
    return "\n".join(lines)


# ---- running ------------------------------------------------------------------------


class Variant(NamedTuple):
    block_size: int
    adaptive: bool = False
    drafter_int8: bool = False
    forced_plain: bool = False
    control: bool = False


# The block column's suffix for each kind of variant (16a: adaptive at block 16).
VARIANT_MARKS = {"adaptive": "a", "drafter_int8": "q", "forced_plain": "p", "control": "c"}


class ForcedPlain:
    """A DFlash engine's row planner that never drafts, for `--forced-plain`: its policy
    finds no plan worth drafting (an infinite margin), so it plans plain by its own rules,
    as it does when drafting does not pay (a plain plan kept while its batch stays about the
    same, looks and probes weighed when due), and the looks and probes it takes are
    decoded plain too. Overruling a planner that still wants to draft instead re-plans at
    every step: that is the planning cost of a drafting step, not of a plain one."""

    def __init__(self, planner: Any) -> None:
        planner.policy.margin = math.inf
        self._planner = planner

    def plan(self, keys: Seq[Any], *args: Any, **kwargs: Any) -> Any:
        kept = self._planner.kept_plan(keys)
        return kept if kept is not None else self.weigh(keys, *args, **kwargs)

    def weigh(self, keys: Seq[Any], *args: Any, **kwargs: Any) -> Any:
        from engine.row_speculation import StepPlan

        self._planner.weigh(keys, *args, **kwargs)
        return StepPlan.plain(len(keys))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


def make_engines(args: argparse.Namespace, variants: list[Variant]) -> dict[Variant, Any]:
    """One loaded engine per variant; block size 1 is the target alone. Adaptive engines
    calibrate their cost model at construction, before any request."""
    from engine.engine import Engine, EngineConfig

    engines: dict[Variant, Any] = {}
    for variant in variants:
        b = variant.block_size
        config = EngineConfig(
            target_path=args.model,
            drafter_path=None if b == 1 else args.drafter,
            num_speculative_tokens=None if b == 1 else b - 1,
            max_num_seqs=max(args.concurrency),
            max_model_len=args.max_model_len,
            max_waiting=4096,
            device=args.device,
            dtype=args.dtype,
            adaptive=variant.adaptive,  # calibrated on its own state before any request
            drafter_int8=variant.drafter_int8,
        )
        engines[variant] = Engine(config)
        if variant.forced_plain:
            runner = engines[variant].runner
            runner.planner = ForcedPlain(runner.planner)
    return engines


def adaptive_report(engine: Any, batch_sizes: list[int]) -> dict[str, Any]:
    """An adaptive engine's start-up cost model, live acceptance rates (of greedy requests,
    what this bench sends, and per temperature band), and the vLLM batch-size -> k table
    they give."""
    from engine.adaptive import speculative_tokens_per_batch_size

    policy, bands = engine.runner.policy, engine.runner.planner.priors.bands
    rates = bands["greedy"].rates()
    return {
        "costs": policy.costs.to_json(),
        "rates": rates,
        "band_rates": {name: stats.rates() for name, stats in bands.items()},
        "table": speculative_tokens_per_batch_size(policy.costs, rates, batch_sizes, policy.max_k),
    }


def drafter_block_size(folder: Path) -> int:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return int(config["block_size"])


def is_greedy(i: int, mix: str) -> bool:
    """Whether request i of a round is greedy (the mixed shape samples the odd ones)."""
    return mix == "greedy" or i % 2 == 0


def request_params(i: int, max_tokens: int, mix: str = "greedy") -> Any:
    """Request i's sampling: greedy, or in the mixed shape at temperature SAMPLED for odd
    i, seeded (seed i) for every other of those."""
    from engine.sequence import SamplingParams

    if is_greedy(i, mix):
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seed = i if i % 4 == 3 else None
    return SamplingParams(max_tokens=max_tokens, temperature=SAMPLED, seed=seed, ignore_eos=True)


def device_sync(device: str) -> None:
    """Wait for a GPU's queued kernels (a timing must hold them); nothing on a CPU."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def run_round(
    engine: Any,
    prompts: list[list[int]],
    concurrency: int,
    max_tokens: int,
    mix: str = "greedy",
    device: str = "cpu",
) -> tuple[int, float, dict[int, list[int]]]:
    """Closed loop: keep `concurrency` requests in flight until every prompt is served.
    Returns (generated tokens, seconds, output token ids per prompt index)."""
    params = [request_params(i, max_tokens, mix) for i in range(len(prompts))]
    outputs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    next_prompt, inflight, tokens = 0, 0, 0
    device_sync(device)
    start = time.perf_counter()
    while next_prompt < len(prompts) or inflight:
        while next_prompt < len(prompts) and inflight < concurrency:
            engine.add_request(str(next_prompt), prompts[next_prompt], params[next_prompt])
            next_prompt, inflight = next_prompt + 1, inflight + 1
        for _, out in engine.step():
            outputs[int(out.request_id)] += out.token_ids_delta
            tokens += len(out.token_ids_delta)
            inflight -= int(out.finished)
    device_sync(device)
    return tokens, time.perf_counter() - start, outputs


def run_benchmark(args: argparse.Namespace, texts: list[str]) -> dict[str, Any]:
    import torch

    from engine.threads import configure_torch_threads

    before = torch.get_num_threads()
    configure_torch_threads(args.threads or None)
    try:
        return _run(args, texts)
    finally:
        torch.set_num_threads(before)


def _variants(args: argparse.Namespace) -> list[Variant]:
    block_sizes = args.block_sizes or [1, drafter_block_size(args.drafter)]
    if 1 not in block_sizes:
        block_sizes = [1, *block_sizes]
    variants = [Variant(b) for b in block_sizes]
    top = max(max(block_sizes), drafter_block_size(args.drafter))
    if args.adaptive:
        variants.append(Variant(top, adaptive=True))
    if args.drafter_int8:
        variants.append(Variant(top, drafter_int8=True))
        if args.adaptive:
            variants.append(Variant(top, adaptive=True, drafter_int8=True))
    if args.forced_plain:
        variants.append(Variant(top, adaptive=True, forced_plain=True))
        variants.append(Variant(1, control=True))
    return variants


def _run(args: argparse.Namespace, texts: list[str]) -> dict[str, Any]:
    variants = _variants(args)
    engines = make_engines(args, variants)
    tokenizer = engines[Variant(1)].tokenizer
    budget = args.max_model_len - args.max_tokens
    prompts = [tokenizer.encode(t)[-budget:] for t in texts]
    for engine in engines.values():  # warm-up: first-call allocations out of the timing
        run_round(engine, prompts[:2], 2, 4, args.mix, args.device)
    cells = {(c, v): Cell(c, *v) for c in args.concurrency for v in variants}
    greedy = [i for i in range(len(prompts)) if is_greedy(i, args.mix)]
    # A seeded request's text is the same whatever the engine drafts (speculative.accept_keyed).
    seeded = [i for i in range(len(prompts)) if request_params(i, 1, args.mix).seed is not None]
    reference: dict[int, list[int]] = {}
    compared = matched = seeded_matched = seeded_compared = 0
    for c in args.concurrency:
        n = max(len(prompts), c * args.requests_per_slot)
        batch = [prompts[i % len(prompts)] for i in range(n)]
        for repeat in range(args.repeats):
            for v in round_order(variants, repeat):
                outs = _measure(engines[v], cells[(c, v)], batch, c, args)
                if not reference:
                    reference = {i: outs[i] for i in greedy + seeded}
                compared += len(greedy)
                matched += sum(outs[i] == reference[i] for i in greedy)
                seeded_compared += len(seeded)
                seeded_matched += sum(outs[i] == reference[i] for i in seeded)
    report = _report(args, variants, cells, matched == compared)
    report["greedy_requests_compared"], report["greedy_requests_matched"] = compared, matched
    report["seeded_requests_compared"] = seeded_compared
    report["seeded_requests_matched"] = seeded_matched
    for v, engine in engines.items():
        if v.adaptive and not (v.drafter_int8 or v.forced_plain):
            info = adaptive_report(engine, sorted({1, 2, 4, 8, 16, *args.concurrency}))
            report["adaptive_costs"], report["adaptive_rates"] = info["costs"], info["rates"]
            report["adaptive_table"] = info["table"]
    return report


def _measure(
    engine: Any, cell: Cell, batch: list[list[int]], c: int, args: argparse.Namespace
) -> dict[int, list[int]]:
    before, forwards = engine.stats(), sum(engine.runner.profile.seconds.values())
    tokens, seconds, outs = run_round(engine, batch, c, args.max_tokens, args.mix, args.device)
    after = engine.stats()
    cell.forward_s += sum(engine.runner.profile.seconds.values()) - forwards
    cell.generated_tokens += tokens
    cell.elapsed_s += seconds
    cell.num_requests += len(batch)
    cell.num_drafts += after.num_drafts - before.num_drafts
    cell.num_draft_tokens += after.num_draft_tokens - before.num_draft_tokens
    cell.num_accepted_tokens += after.num_accepted_tokens - before.num_accepted_tokens
    cell.runs_tokens_per_second.append(tokens / seconds if seconds > 0 else 0.0)
    return outs


def _report(
    args: argparse.Namespace,
    variants: list[Variant],
    cells: dict[tuple[int, Variant], Cell],
    outputs_match: bool,
) -> dict[str, Any]:
    import torch

    results = [
        cells[(c, v)].to_json(cells[(c, Variant(1))]) for c in args.concurrency for v in variants
    ]
    block_sizes = [v.block_size for v in variants if v == Variant(v.block_size)]
    return {
        "benchmark": "engine",
        "model": str(args.model),
        "drafter": str(args.drafter),
        "block_sizes": block_sizes,
        "concurrency": list(args.concurrency),
        "max_tokens": args.max_tokens,
        "mix": args.mix,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "device": args.device,
        "dtype": args.dtype,
        "outputs_match": outputs_match,
        "adaptive": bool(args.adaptive),
        "drafter_int8": bool(args.drafter_int8),
        "forced_plain": bool(args.forced_plain),
        "results": results,
    }


RSS_CHILD = """
import json, resource, sys
from pathlib import Path
from engine.threads import configure_torch_threads
from engine.engine import Engine, EngineConfig
from engine.sequence import SamplingParams
target, drafter, seqs, context, new = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
configure_torch_threads(1)
engine = Engine(EngineConfig(target_path=Path(target), drafter_path=Path(drafter),
                             max_num_seqs=seqs, max_model_len=context))
params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
for i in range(seqs):
    engine.add_request(str(i), [(i * 31 + j) % 1000 + 5 for j in range(context - new)], params)
done = 0
for _ in range(100000):
    done += sum(out.finished for out in engine.step())
    if done == seqs:
        break
peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_rss_mb": peak_kb / 1024.0, "finished": done}))
"""


def measure_peak_rss(
    args: argparse.Namespace, sequences: int = 16, context: int = 2048, new_tokens: int = 32
) -> dict[str, Any]:
    """Peak RSS of a fresh process running one DFlash engine with `sequences` requests
    whose prompts fill the context (minus `new_tokens` generated)."""
    import subprocess

    cmd = [
        sys.executable,
        "-c",
        RSS_CHILD,
        str(args.model),
        str(args.drafter),
        str(sequences),
        str(context),
        str(new_tokens),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    result.update(sequences=sequences, context=context, new_tokens=new_tokens)
    return result
