"""`dflash-bench engine`: the embedded engine's decoding speed, DFlash against plain.

For every concurrency and every block size (1 = plain decoding, and the drafter's) it runs
the same greedy requests through the engine directly (no HTTP) and reports generated
tokens/s, the mean acceptance length, and the speedup over block size 1 at the same
concurrency. One engine per block size stays loaded and the repeats are interleaved
(plain, DFlash, plain, DFlash, ...) so a noisy machine affects both sides alike. Greedy
outputs must be identical across block sizes; the JSON says whether they were.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BUNDLED = Path(__file__).resolve().parents[1] / "engine" / "assets" / "tiny-coder"


@dataclass
class Cell:
    """One (concurrency, block size) pair, summed over its repeats."""

    concurrency: int
    block_size: int
    generated_tokens: int = 0
    elapsed_s: float = 0.0
    num_requests: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    runs_tokens_per_second: list[float] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def to_json(self, baseline: Cell | None) -> dict[str, Any]:
        out = asdict(self)
        out["tokens_per_second"] = self.tokens_per_second
        out["mean_acceptance_length"] = self.mean_acceptance_length
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


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers: {text!r}")
    return values


def parse_args(argv: Seq[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dflash-bench engine", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=BUNDLED / "target", help="target folder")
    p.add_argument("--drafter", type=Path, default=BUNDLED / "dflash", help="DFlash folder")
    p.add_argument("--concurrency", type=_int_list, default=[1, 4, 8])
    p.add_argument(
        "--block-sizes",
        type=_int_list,
        default=None,
        help="block sizes to compare (default: 1 and the drafter's)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
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
        help="torch intra-op threads (0 = torch default); 1 suits small models, whose "
        "matmuls are too small to split and whose spare threads only spin",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p.parse_args(list(argv))


def load_prompts(path: Path | None, n: int) -> list[str]:
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
    report = run_benchmark(args, load_prompts(args.prompts, args.num_prompts))
    print(format_table(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


def format_table(report: dict[str, Any]) -> str:
    head = (
        f"{'conc':>5} {'block':>5} {'tok/s':>9} {'accept len':>10} {'speedup':>8} "
        f"{'median':>7} {'tokens':>7}"
    )
    lines = [
        f"engine benchmark: {report['model']} + {report['drafter']} "
        f"(max_tokens {report['max_tokens']}, repeats {report['repeats']}, "
        f"threads {report['threads']})",
        head,
        "-" * len(head),
    ]
    for r in report["results"]:
        speedup, median = r["speedup_vs_block_size_1"], r["median_paired_speedup"]
        lines.append(
            f"{r['concurrency']:>5} {r['block_size']:>5} {r['tokens_per_second']:>9.1f} "
            f"{r['mean_acceptance_length']:>10.2f} "
            f"{'-' if speedup is None else f'{speedup:.2f}x':>8} "
            f"{'-' if median is None else f'{median:.2f}x':>7} {r['generated_tokens']:>7}"
        )
    lines.append(f"greedy outputs identical across block sizes: {report['outputs_match']}")
    return "\n".join(lines)


# ---- running ------------------------------------------------------------------------


def make_engines(args: argparse.Namespace, block_sizes: list[int]) -> dict[int, Any]:
    """One loaded engine per block size; block size 1 is the target alone."""
    from engine.engine import Engine, EngineConfig

    engines: dict[int, Any] = {}
    for b in block_sizes:
        config = EngineConfig(
            target_path=args.model,
            drafter_path=None if b == 1 else args.drafter,
            num_speculative_tokens=None if b == 1 else b - 1,
            max_num_seqs=max(args.concurrency),
            max_model_len=args.max_model_len,
            max_waiting=4096,
            device=args.device,
            dtype=args.dtype,
        )
        engines[b] = Engine(config)
    return engines


def drafter_block_size(folder: Path) -> int:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return int(config["block_size"])


def run_round(
    engine: Any, prompts: list[list[int]], concurrency: int, max_tokens: int
) -> tuple[int, float, dict[int, list[int]]]:
    """Closed loop: keep `concurrency` requests in flight until every prompt is served.
    Returns (generated tokens, seconds, output token ids per prompt index)."""
    from engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    next_prompt, inflight, tokens = 0, 0, 0
    start = time.perf_counter()
    while next_prompt < len(prompts) or inflight:
        while next_prompt < len(prompts) and inflight < concurrency:
            engine.add_request(str(next_prompt), prompts[next_prompt], params)
            next_prompt, inflight = next_prompt + 1, inflight + 1
        for _, out in engine.step():
            outputs[int(out.request_id)] += out.token_ids_delta
            tokens += len(out.token_ids_delta)
            inflight -= int(out.finished)
    return tokens, time.perf_counter() - start, outputs


def run_benchmark(args: argparse.Namespace, texts: list[str]) -> dict[str, Any]:
    import torch

    before = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, texts)
    finally:
        torch.set_num_threads(before)


def _run(args: argparse.Namespace, texts: list[str]) -> dict[str, Any]:
    block_sizes = args.block_sizes or [1, drafter_block_size(args.drafter)]
    if 1 not in block_sizes:
        block_sizes = [1, *block_sizes]
    engines = make_engines(args, block_sizes)
    tokenizer = engines[1].tokenizer
    budget = args.max_model_len - args.max_tokens
    prompts = [tokenizer.encode(t)[-budget:] for t in texts]
    for engine in engines.values():  # warm-up: first-call allocations out of the timing
        run_round(engine, prompts[:1], 1, 4)
    cells = {(c, b): Cell(c, b) for c in args.concurrency for b in block_sizes}
    reference: dict[int, list[int]] = {}
    outputs_match = True
    for c in args.concurrency:
        n = max(len(prompts), c * args.requests_per_slot)
        batch = [prompts[i % len(prompts)] for i in range(n)]
        for _ in range(args.repeats):
            for b in block_sizes:
                outs = _measure(engines[b], cells[(c, b)], batch, c, args)
                if not reference:
                    reference = {i: outs[i] for i in range(len(prompts))}
                outputs_match &= all(outs[i] == reference[i] for i in range(len(prompts)))
    return _report(args, block_sizes, cells, outputs_match)


def _measure(
    engine: Any, cell: Cell, batch: list[list[int]], c: int, args: argparse.Namespace
) -> dict[int, list[int]]:
    before = engine.stats()
    tokens, seconds, outs = run_round(engine, batch, c, args.max_tokens)
    after = engine.stats()
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
    block_sizes: list[int],
    cells: dict[tuple[int, int], Cell],
    outputs_match: bool,
) -> dict[str, Any]:
    import torch

    results = [cells[(c, b)].to_json(cells[(c, 1)]) for c in args.concurrency for b in block_sizes]
    return {
        "benchmark": "engine",
        "model": str(args.model),
        "drafter": str(args.drafter),
        "block_sizes": block_sizes,
        "concurrency": list(args.concurrency),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "device": args.device,
        "dtype": args.dtype,
        "outputs_match": outputs_match,
        "results": results,
    }
