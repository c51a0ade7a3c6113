"""`dflash-bench speedup`: what DFlash gives a user, end to end: the embedded worker with
DFlash (its default, adaptive speculation) against the same worker plain, through HTTP.

Two `dflash-worker`s serve the bundled tiny-coder, started as a user starts them:

    dflash-worker --max-num-seqs 32 ...                      (DFlash, bundled drafter)
    dflash-worker --max-num-seqs 32 --no-speculation ...     (plain)

Both stay up; the rounds alternate between them (one at a time, the order alternating from round
to round, each round waiting until both workers are quiet), so a change in the machine's load
weighs on both alike. Every round sends, at each concurrency (closed loop), the same requests
to each worker: prompts cut from held-out code (never trained on) to 32..512 tokens, 64..256
new tokens each (`ignore_eos`, so both workers generate exactly as many), chat and completions
alternating, greedy (or `--temperature`); once streamed and once not. Reported per (streaming,
concurrency): each worker's generated tokens/s (completion tokens from `usage` over the rounds'
wall time), the ratio DFlash / plain over all rounds and its range over single rounds, DFlash's
mean acceptance length and the share of its steps that verified no draft. Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.backends_bench import (
    MODEL_NAME,
    RunningWorker,
    WorkerSpec,
    running_workers,
    settle,
    worker_env,
)
from loadtest.chat_stream import iter_sse_data
from loadtest.harness import closed_loop, git_commit, int_list, round_order

REPO = Path(__file__).resolve().parents[1]
# --matrix (loadtest/speedup_matrix.py): its longest prompt and answer, and the context for it.
MATRIX_LONGEST = 1536 + 256
MATRIX_MAX_MODEL_LEN = 2048
MODES = ("dflash", "plain")


# ---- the workload ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    endpoint: str  # chat | completions
    prompt: str
    prompt_tokens: int  # as the target's tokenizer counts the prompt text
    max_tokens: int


def spread(low: int, high: int, n: int) -> list[int]:
    """n integers from low to high (both included), evenly spaced on a log scale."""
    if n == 1:
        return [low]
    return [round(low * (high / low) ** (i / (n - 1))) for i in range(n)]


def build_workload(
    n: int, prompt_range: tuple[int, int], new_range: tuple[int, int]
) -> list[Request]:
    """n requests; prompt lengths and new tokens each spread over their range and paired
    so that long prompts do not always come with long answers."""
    from engine.tokenizer import Tokenizer
    from engine.train.corpus import heldout_prompts
    from engine.worker.settings import BUNDLED_TARGET

    tokenizer = Tokenizer.from_dir(BUNDLED_TARGET)
    lengths = spread(*prompt_range, n)
    news = spread(*new_range, n)
    texts = heldout_prompts(n, max_chars=8 * prompt_range[1])
    requests = []
    for i, (text, length) in enumerate(zip(texts, lengths, strict=True)):
        ids = tokenizer.encode(text, add_special_tokens=False)[-length:]  # keep the end: a def
        prompt = tokenizer.decode(ids)
        requests.append(
            Request(
                endpoint="chat" if i % 2 else "completions",
                prompt=prompt,
                prompt_tokens=len(tokenizer.encode(prompt, add_special_tokens=False)),
                max_tokens=news[(i * 7) % n],  # a fixed shuffle: 7 is prime to most n
            )
        )
    return requests


def request_body(
    req: Request,
    stream: bool,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    seed: int | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "max_tokens": req.max_tokens,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "stream": stream,
    }
    if seed is not None:
        body["seed"] = seed
    if req.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


# ---- one request ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One completed request, as the worker reported it."""

    tokens: int
    latency_s: float
    acceptance_length: float | None
    spec_steps: int
    plain_steps: int


def outcome(usage: dict[str, Any], metrics: dict[str, Any], latency_s: float) -> Outcome:
    spec = metrics.get("speculative_decoding") or {}
    accept = spec.get("mean_acceptance_length")
    return Outcome(
        tokens=int(usage.get("completion_tokens", 0)),
        latency_s=latency_s,
        acceptance_length=float(accept) if accept is not None else None,
        spec_steps=int(spec.get("num_spec_steps") or 0),
        plain_steps=int(spec.get("num_plain_steps") or 0),
    )


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    req: Request,
    stream: bool,
    temperature: float,
    ignore_eos: bool = True,
    seed: int | None = None,
) -> Outcome | None:
    path = "/v1/chat/completions" if req.endpoint == "chat" else "/v1/completions"
    body = request_body(req, stream, temperature, ignore_eos, seed)
    start = time.perf_counter()
    try:
        if not stream:
            response = await client.post(url + path, json=body)
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
            body = response.json()
            return outcome(body.get("usage") or {}, body.get("metrics") or {}, _since(start))
        usage: dict[str, Any] = {}
        metrics: dict[str, Any] = {}
        async with client.stream("POST", url + path, json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}")
            lines = [line async for line in response.aiter_lines()]
        for event in iter_sse_data(lines):
            usage = event.get("usage") or usage
            metrics = event.get("metrics") or metrics
        return outcome(usage, metrics, _since(start))
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        print(f"  {url}{path}: {exc!r}", file=sys.stderr)
        return None


def _since(start: float) -> float:
    return time.perf_counter() - start


async def run_round(
    client: httpx.AsyncClient,
    url: str,
    requests: Sequence[Request],
    c: int,
    stream: bool,
    temperature: float = 0.0,
) -> tuple[list[Outcome | None], float]:
    """Closed loop: `c` requests in flight until every request has been served."""

    async def send(i: int) -> Outcome | None:
        return await one_request(client, url, requests[i], stream, temperature)

    return await closed_loop(len(requests), c, send)


# ---- cells ----------------------------------------------------------------------------------


@dataclass
class Cell:
    """One (worker, streaming, concurrency), summed over its rounds."""

    tokens: int = 0
    elapsed_s: float = 0.0
    errors: int = 0
    rounds_tokens_per_second: list[float] = field(default_factory=list)
    acceptance_lengths: list[float] = field(default_factory=list)
    spec_steps: int = 0
    plain_steps: int = 0

    def add_round(self, results: Sequence[Outcome | None], seconds: float) -> None:
        done = [r for r in results if r is not None]
        tokens = sum(r.tokens for r in done)
        self.tokens += tokens
        self.elapsed_s += seconds
        self.errors += len(results) - len(done)
        self.rounds_tokens_per_second.append(tokens / seconds if seconds > 0 else 0.0)
        for r in done:
            if r.acceptance_length is not None:
                self.acceptance_lengths.append(r.acceptance_length)
            self.spec_steps += r.spec_steps
            self.plain_steps += r.plain_steps

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


Key = tuple[str, bool, int]  # (worker mode, streaming, concurrency)


def result_rows(cells: dict[Key, Cell], streams: Sequence[bool], cs: Sequence[int]) -> list[Any]:
    rows = []
    for stream in streams:
        for c in cs:
            fast, plain = cells[("dflash", stream, c)], cells[("plain", stream, c)]
            paired = zip(fast.rounds_tokens_per_second, plain.rounds_tokens_per_second, strict=True)
            per_round = [f / p for f, p in paired if p > 0]
            steps = fast.spec_steps + fast.plain_steps
            rows.append(
                {
                    "stream": stream,
                    "concurrency": c,
                    "dflash_tokens_per_second": fast.tokens_per_second,
                    "plain_tokens_per_second": plain.tokens_per_second,
                    "ratio": fast.tokens_per_second / plain.tokens_per_second
                    if plain.tokens_per_second > 0
                    else None,
                    "ratio_per_round": per_round,
                    "mean_acceptance_length": _mean(fast.acceptance_lengths),
                    "plain_step_share": fast.plain_steps / steps if steps else None,
                    "generated_tokens": {"dflash": fast.tokens, "plain": plain.tokens},
                    "errors": fast.errors + plain.errors,
                }
            )
    return rows


def start_spread(
    starts: Sequence[dict[Key, Cell]], streams: Sequence[bool], cs: Sequence[int]
) -> list[dict[str, Any]]:
    """Each start's rows (marked with the start's number)."""
    out = []
    for i, cells in enumerate(starts):
        rows = [{**row, "start": i + 1} for row in result_rows(cells, streams, cs)]
        out.append({"start": i + 1, "results": rows})
    return out


def format_spread(starts: Sequence[dict[str, Any]]) -> str:
    """Per (stream, concurrency): the ratio of each start, and their range."""
    by_cell: dict[tuple[bool, int], list[float]] = {}
    for start in starts:
        for row in start["results"]:
            if row["ratio"] is not None:
                by_cell.setdefault((row["stream"], row["concurrency"]), []).append(row["ratio"])
    lines = ["spread over starts (DFlash / plain, each start's ratio):"]
    for (stream, c), ratios in by_cell.items():
        each = " ".join(f"{r:.2f}" for r in ratios)
        lines.append(
            f"  stream={'yes' if stream else 'no'} c={c}: {min(ratios):.2f}-{max(ratios):.2f}"
            f"  ({each})"
        )
    return "\n".join(lines)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def format_table(report: dict[str, Any]) -> str:
    head = (
        f"{'stream':>6} {'c':>3} {'plain tok/s':>12} {'DFlash tok/s':>13} {'ratio':>6} "
        f"{'rounds':>12} {'accept':>7} {'plain steps':>12} {'err':>4}"
    )
    lines = [head, "-" * len(head)]
    for r in report["results"]:
        rounds = r["ratio_per_round"]
        span = f"{min(rounds):.2f}-{max(rounds):.2f}" if rounds else "-"
        accept = r["mean_acceptance_length"]
        share = r["plain_step_share"]
        lines.append(
            f"{'yes' if r['stream'] else 'no':>6} {r['concurrency']:>3} "
            f"{r['plain_tokens_per_second']:>12.1f} {r['dflash_tokens_per_second']:>13.1f} "
            f"{r['ratio'] or 0.0:>6.2f} {span:>12} "
            f"{'-' if accept is None else f'{accept:.2f}':>7} "
            f"{'-' if share is None else f'{share:.0%}':>12} {r['errors']:>4}"
        )
    return "\n".join(lines)


# ---- the run --------------------------------------------------------------------------------


def worker_argv(spec: WorkerSpec, port: int, args: argparse.Namespace) -> list[str]:
    """The worker as a user starts it: defaults but for the port, the slots and the length."""
    argv = [sys.executable, "-m", "engine.worker.cli", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--served-model-name", MODEL_NAME, "--max-num-seqs", str(args.max_num_seqs)]
    argv += ["--max-model-len", str(args.max_model_len), "--seed", "0"]
    if spec.mode in ("plain", "control"):  # the control: a second plain worker
        return [*argv, "--no-speculation"]
    if spec.mode == "dflash2":  # the bundled DFlash2 drafter, the worker's default speculation
        from engine.worker.settings import BUNDLED_DFLASH2

        second = {"method": "dflash2", "model": str(BUNDLED_DFLASH2)}
        return [*argv, "--speculative-config", json.dumps(second)]
    if spec.mode.startswith("fixed-"):  # the same drafter, every step verifying K drafts
        from engine.worker.settings import BUNDLED_DRAFTER

        k = int(spec.mode.removeprefix("fixed-"))
        config = {"method": "dflash", "model": str(BUNDLED_DRAFTER), "num_speculative_tokens": k}
        return [*argv, "--speculation", "fixed", "--speculative-config", json.dumps(config)]
    return argv  # dflash, and a --tree checkout's dflash: their defaults


async def measure(
    workers: Sequence[RunningWorker], requests: Sequence[Request], args: argparse.Namespace
) -> dict[Key, Cell]:
    keys = [(w.spec.mode, s, c) for w in workers for s in args.streams for c in args.concurrency]
    cells = {key: Cell() for key in keys}
    # Idle connections are dropped before the worker's 5 s keep-alive ends: a request sent
    # on one the worker is closing fails with a ReadError, which is the client's race.
    limits = httpx.Limits(max_connections=max(args.concurrency) * 2, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        for w in workers:  # first-call allocations and batch shapes out of the timing
            for c in args.concurrency:
                await run_round(client, w.url, requests[:c], c, False, args.temperature)
        for r in range(args.rounds):
            for stream in args.streams:
                for c in args.concurrency:
                    batch = [requests[i % len(requests)] for i in range(_round_size(c, args))]
                    for w in round_order(workers, r):
                        await settle(workers)
                        results, seconds = await run_round(
                            client, w.url, batch, c, stream, args.temperature
                        )
                        cell = cells[(w.spec.mode, stream, c)]
                        cell.add_round(results, seconds)
                        print(
                            f"  round {r + 1}/{args.rounds} stream={stream} c={c} "
                            f"{w.spec.mode}: {cell.rounds_tokens_per_second[-1]:.1f} tok/s",
                            flush=True,
                        )
    return cells


def _round_size(c: int, args: argparse.Namespace) -> int:
    return int(max(args.num_requests, c * args.requests_per_slot))


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        pair = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH, got {text!r}") from None
    if not 1 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return pair


def _streams(text: str) -> list[bool]:
    names = {"yes": [True], "no": [False], "both": [False, True]}
    if text not in names:
        raise argparse.ArgumentTypeError(f"expected yes, no or both, got {text!r}")
    return names[text]


DEFAULTS = {  # full run / --quick (the test's): used for every option left unset
    "concurrency": ([1, 2, 4, 8, 16, 32], [1, 2]),
    "rounds": (3, 1),
    "prompt_tokens": ((32, 512), (32, 64)),
    "new_tokens": ((64, 256), (8, 16)),
    "num_requests": (8, 2),
    "min_requests": (8, 1),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflash-bench speedup", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    p.add_argument("--concurrency", type=int_list, default=None, help="default 1,2,4,8,16,32")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3)")
    p.add_argument("--stream", dest="streams", type=_streams, default=[False, True],
                   help="yes, no or both (default both)")  # fmt: skip
    p.add_argument("--prompt-tokens", type=_range, default=None, help="default 32-512")
    p.add_argument("--new-tokens", type=_range, default=None, help="default 64-256")
    p.add_argument("--num-requests", type=int, default=None, help="least per round (default 8)")
    p.add_argument(
        "--requests-per-slot",
        type=int,
        default=None,
        help="round = max(n, c x this) (default 2; --matrix: a closed loop's per client, 3)",
    )
    p.add_argument(
        "--min-requests",
        type=int,
        default=None,
        help="--matrix: the least requests a cell sends per worker and round (small bursts "
        "are repeated; default 8)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="of every request (default 0, greedy; 1.0: drafts are rarely accepted)",
    )
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: largest concurrency")
    p.add_argument("--max-model-len", type=int, default=None, help="default 1024 (--matrix: 2048)")
    p.add_argument(
        "--fixed",
        type=int_list,
        default=[],
        help="--matrix: also DFlash workers verifying K drafts every step (e.g. 7,15), at c=1",
    )
    p.add_argument(
        "--tree",
        type=Path,
        default=None,
        help="--matrix: also the DFlash worker of another checkout (e.g. a git worktree of an "
        "older commit), in every cell",
    )
    p.add_argument(
        "--control",
        action="store_true",
        help="--matrix: also a second plain worker in every cell; each row then reports its "
        "tokens/s over the first's (an A/A ratio: what the bench reads between two identical "
        "workers, the resolution of every other ratio)",
    )
    p.add_argument(
        "--dflash2",
        action="store_true",
        help="--matrix: also a worker with the bundled DFlash2 drafter in every cell (its "
        "ratio over plain and over DFlash: issue 45's worst-cell goal)",
    )
    p.add_argument(
        "--reverse-starts",
        action="store_true",
        help="--matrix: start the workers in the reverse order (a worker started later read "
        "up to about 10 %% faster than its twin here: compare both orders)",
    )
    p.add_argument(
        "--together",
        action="store_true",
        help="--matrix: start the workers at the same moment rather than one at a time (a "
        "worker started first, alone, read about 2 %% slower than its twin started last)",
    )
    p.add_argument(
        "--restarts",
        action="store_true",
        help="--matrix: start the workers afresh for every round, in the reverse order every "
        "other round, so that a reading spans as many processes as rounds (a process can run "
        "its steps a few %% faster or slower than its twin for the whole of its life)",
    )
    p.add_argument(
        "--starts",
        type=int,
        default=1,
        help="start both workers at the same moment this many times, measuring after each "
        "start (the spread of DFlash's start-up calibration under a busy neighbour)",
    )
    p.add_argument(
        "--matrix",
        action="store_true",
        help="every workload shape (prompt and output lengths, arrivals, temperatures, "
        "streaming) in one table: loadtest/speedup_matrix.py",
    )
    p.add_argument(
        "--shapes",
        type=lambda text: [name for name in text.split(",") if name],
        default=None,
        help="--matrix: only these shapes, by name (a mixed shape brings its greedy twin)",
    )
    p.add_argument("--quick", action="store_true", help="tiny run: 1 round, c=1,2, short")
    p.add_argument("--threads", type=int, default=0, help="OMP threads per worker (0: default)")
    p.add_argument("--port-base", type=int, default=0, help="ports base, base+1 (default: free)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--log-dir", type=Path, default=None, help="worker logs (default: temp)")
    p.add_argument("--json", type=Path, default=Path("bench-results/speedup.json"))
    return p


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    for name, (full, quick) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.max_num_seqs = args.max_num_seqs or max(args.concurrency)
    args.requests_per_slot = args.requests_per_slot or (3 if args.matrix else 2)
    args.max_model_len = args.max_model_len or (MATRIX_MAX_MODEL_LEN if args.matrix else 1024)
    if args.matrix and args.starts > 1:
        parser.error("--starts measures one workload: not with --matrix")
    matrix_only = {
        "--fixed": args.fixed,
        "--tree": args.tree,
        "--control": args.control,
        "--dflash2": args.dflash2,
        "--shapes": args.shapes,
        "--reverse-starts": args.reverse_starts,
        "--restarts": args.restarts,
        "--together": args.together,
    }
    given = [name for name, value in matrix_only.items() if value]
    if given and not args.matrix:
        parser.error(f"{', '.join(given)}: --matrix options only")
    if args.tree is not None and not (args.tree / "engine" / "worker" / "cli.py").is_file():
        parser.error(f"--tree {args.tree}: not a dflash-serving checkout")
    for name in ("rounds", "num_requests", "requests_per_slot", "starts"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    longest = MATRIX_LONGEST if args.matrix else sum((args.prompt_tokens[1], args.new_tokens[1]))
    if longest + 64 > args.max_model_len:
        parser.error("--max-model-len must hold the longest prompt, its answer and a template")
    return args


def build_report(
    args: argparse.Namespace, requests: Sequence[Request], cells: dict[Key, Cell], load: list[float]
) -> dict[str, Any]:
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    return {
        "benchmark": "speedup",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "model": MODEL_NAME,
        "config": config,
        "workers": {m: worker_argv(WorkerSpec("embedded", m), 0, args)[1:] for m in MODES},
        "workload": [
            {"endpoint": r.endpoint, "prompt_tokens": r.prompt_tokens, "max_tokens": r.max_tokens}
            for r in requests
        ],
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average": load,
        },
        "results": result_rows(cells, args.streams, args.concurrency),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.matrix:  # a variant of its own, which imports this module
        raise SystemExit(
            "--matrix: run `dflash-bench speedup --matrix` (loadtest/speedup_matrix.py)"
        )
    n = max(args.num_requests, max(args.concurrency) * args.requests_per_slot)
    requests = build_workload(n, args.prompt_tokens, args.new_tokens)
    specs = [WorkerSpec("embedded", mode) for mode in MODES]
    starts: list[dict[Key, Cell]] = []
    with contextlib.ExitStack() as stack:
        log_dir = args.log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        log_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(args.starts):  # together: each start has the other as a neighbour
            together = args.starts > 1
            launch = running_workers(
                specs, args, log_dir, argv=worker_argv, env=worker_env, together=together
            )
            with launch as workers:
                starts.append(asyncio.run(measure(workers, requests, args)))
    report = build_report(args, requests, starts[0], list(os.getloadavg()))
    if args.starts > 1:
        report["starts"] = start_spread(starts, args.streams, args.concurrency)
        report["results"] = [row for start in report["starts"] for row in start["results"]]
    print(format_table(report))
    if args.starts > 1:
        print(format_spread(report["starts"]))
    return write_report(report, args.json)


def write_report(report: dict[str, Any], path: Path) -> int:
    """The JSON report to `path`; the exit status: 1 if any request failed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return 1 if any(row["errors"] for row in report["results"]) else 0
