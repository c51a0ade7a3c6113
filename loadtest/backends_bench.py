"""`dflash-bench backends`: the embedded worker against real vLLM, each plain and with DFlash.

Four workers serve the same model (the bundled tiny-coder target; DFlash with its bundled
drafter), started through `dflash-worker` exactly as a user starts them:

    python -m engine.worker.cli [--backend vllm] --dtype float32 [--no-speculation] ...

They start one after the other and then all stay up: a quiet worker costs memory, not CPU,
so the measurement rounds can alternate between them. Each round sends the same greedy
`/v1/completions` requests (held-out code prompts, `ignore_eos`, so every request generates
exactly `--max-tokens`) to one worker at a time in a closed loop at each concurrency, and the
order of the workers changes from round to round (`round_order`): a change in the machine's
load weighs on every worker alike. Before each round the benchmark waits until every worker
is quiet (real vLLM polls on a busy core for about a second after its last request), and it
records the CPU each worker used, during its own rounds and during the others'. Reported
per (worker, concurrency): generated tokens/s (completion tokens from `usage` over the
rounds' wall time), per-user tokens/s, and the mean acceptance length the worker reports per
request (`metrics.speculative_decoding`). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from launcher.processes import cpu_seconds, free_port, rss_mib, stop, wait_healthy
from loadtest.harness import closed_loop, git_commit, int_list, round_order

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ("embedded", "vllm")
MODES = ("plain", "dflash")
MODEL_NAME = "tiny-coder"
# KV cache of each vLLM worker (GiB). Unsized, vLLM's CPU build wants --gpu-memory-utilization
# (0.9) of a NUMA node's memory free at start and refuses to start on a shared machine.
VLLM_KV_GIB = "1"


# ---- what is measured -----------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    backend: str  # embedded | vllm
    mode: str  # plain | dflash

    @property
    def name(self) -> str:
        return f"{self.backend}-{self.mode}"


@dataclass(frozen=True)
class RequestResult:
    """One completed request, as the worker reported it."""

    tokens: int
    latency_s: float
    text: str
    acceptance_length: float | None  # metrics.speculative_decoding.mean_acceptance_length
    spec_steps: int
    accepted_draft_tokens: int


@dataclass
class Cell:
    """One (worker, concurrency) pair, summed over its rounds."""

    worker: str
    concurrency: int
    generated_tokens: int = 0
    elapsed_s: float = 0.0
    num_requests: int = 0
    errors: int = 0
    runs_tokens_per_second: list[float] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    user_tokens_per_second: list[float] = field(default_factory=list)
    acceptance_lengths: list[float] = field(default_factory=list)
    spec_steps: int = 0
    accepted_draft_tokens: int = 0
    texts: dict[int, str] = field(default_factory=dict)  # prompt index -> first text seen
    cpu_s: float = 0.0  # the worker's process tree, during its rounds

    def add_round(self, results: Sequence[RequestResult | None], seconds: float) -> None:
        done = [r for r in results if r is not None]
        tokens = sum(r.tokens for r in done)
        self.generated_tokens += tokens
        self.elapsed_s += seconds
        self.num_requests += len(results)
        self.errors += len(results) - len(done)
        self.runs_tokens_per_second.append(tokens / seconds if seconds > 0 else 0.0)
        for r in done:
            self.latencies_s.append(r.latency_s)
            if r.latency_s > 0:
                self.user_tokens_per_second.append(r.tokens / r.latency_s)
            if r.acceptance_length is not None:
                self.acceptance_lengths.append(r.acceptance_length)
            self.spec_steps += r.spec_steps
            self.accepted_draft_tokens += r.accepted_draft_tokens

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


def parse_result(body: dict[str, Any], latency_s: float) -> RequestResult:
    """A non-streaming completion's tokens, text and per-request speculation metrics."""
    usage = body.get("usage") or {}
    metrics = body.get("metrics") or {}
    spec = metrics.get("speculative_decoding") or {}
    accept = spec.get("mean_acceptance_length")
    choices = body.get("choices") or [{}]
    return RequestResult(
        tokens=int(usage.get("completion_tokens", 0)),
        latency_s=latency_s,
        text=str(choices[0].get("text", "")),
        acceptance_length=float(accept) if accept is not None else None,
        spec_steps=int(spec.get("num_spec_steps") or 0),
        accepted_draft_tokens=int(spec.get("num_accepted_draft_tokens") or 0),
    )


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def cell_json(cell: Cell, plain: Cell | None, reference: Cell | None) -> dict[str, Any]:
    """A cell's JSON row: `plain` is the same backend's plain cell at the same concurrency
    (the speedup's baseline), `reference` the cell whose greedy texts the others are
    compared with."""
    spec = cell.spec_steps
    paired = []
    if plain is not None:
        pairs = zip(cell.runs_tokens_per_second, plain.runs_tokens_per_second, strict=True)
        paired = [mine / base for mine, base in pairs if base > 0]
    base_tps = plain.tokens_per_second if plain is not None else 0.0
    row: dict[str, Any] = {
        "worker": cell.worker,
        "concurrency": cell.concurrency,
        "tokens_per_second": cell.tokens_per_second,
        "user_tokens_per_second": _mean(cell.user_tokens_per_second),
        "mean_latency_s": _mean(cell.latencies_s),
        # Mean over requests of the worker's per-request figure (bonus token included).
        "mean_acceptance_length": _mean(cell.acceptance_lengths),
        # The same pooled over requests: 1 + accepted drafts / verify steps.
        "pooled_acceptance_length": 1 + cell.accepted_draft_tokens / spec if spec else None,
        "speedup_vs_plain": cell.tokens_per_second / base_tps if base_tps > 0 else None,
        "paired_speedups_vs_plain": paired,
        "median_paired_speedup": statistics.median(paired) if paired else None,
        # CPU the worker's processes used during its rounds: cores busy on average.
        "cores_used": cell.cpu_s / cell.elapsed_s if cell.elapsed_s > 0 else None,
        "generated_tokens": cell.generated_tokens,
        "elapsed_s": cell.elapsed_s,
        "num_requests": cell.num_requests,
        "errors": cell.errors,
        "runs_tokens_per_second": cell.runs_tokens_per_second,
        "texts_match_reference": _matches(cell, reference),
    }
    return row


def _matches(cell: Cell, reference: Cell | None) -> str | None:
    """ "k/n": prompts whose greedy text equals the reference worker's for the same prompt."""
    if reference is None:
        return None
    shared = [i for i in cell.texts if i in reference.texts]
    same = sum(cell.texts[i] == reference.texts[i] for i in shared)
    return f"{same}/{len(shared)}"


def build_results(
    cells: dict[tuple[str, int], Cell], workers: Sequence[WorkerSpec], concurrency: Sequence[int]
) -> list[dict[str, Any]]:
    """One row per (worker, concurrency), concurrency-major. Texts are compared with the
    first worker's at concurrency 1 (embedded plain decoding: the greedy oracle)."""
    reference = cells.get((workers[0].name, min(concurrency))) if workers else None
    rows = []
    for c in concurrency:
        for w in workers:
            plain = cells.get((f"{w.backend}-plain", c))
            rows.append(cell_json(cells[(w.name, c)], plain, reference))
    return rows


def format_table(report: dict[str, Any]) -> str:
    cfg = report["config"]
    head = (
        f"{'worker':<16} {'conc':>4} {'tok/s':>8} {'user tok/s':>10} {'accept':>6} "
        f"{'vs plain':>8} {'median':>7} {'cores':>5} {'reqs':>5} {'err':>3} {'text=ref':>8}"
    )
    lines = [
        f"backends benchmark: {report['model']} (dtype {cfg['dtype']}, max_tokens "
        f"{cfg['max_tokens']}, rounds {cfg['rounds']}, threads {cfg['threads']})",
        head,
        "-" * len(head),
    ]

    def fmt(value: float | None, spec: str, suffix: str = "") -> str:
        return "-" if value is None else f"{value:{spec}}{suffix}"

    for r in report["results"]:
        lines.append(
            f"{r['worker']:<16} {r['concurrency']:>4} {r['tokens_per_second']:>8.1f} "
            f"{fmt(r['user_tokens_per_second'], '.1f'):>10} "
            f"{fmt(r['mean_acceptance_length'], '.2f'):>6} "
            f"{fmt(r['speedup_vs_plain'], '.2f', 'x'):>8} "
            f"{fmt(r['median_paired_speedup'], '.2f', 'x'):>7} "
            f"{fmt(r['cores_used'], '.2f'):>5} "
            f"{r['num_requests']:>5} {r['errors']:>3} {r['texts_match_reference'] or '-':>8}"
        )
    rss = ", ".join(f"{k} {v} MiB" for k, v in report["workers_rss_mib"].items())
    lines.append(f"worker memory (RSS, process tree): {rss}")
    busy = ", ".join(f"{k} {v:.3f}" for k, v in report["workers_idle_cores"].items())
    lines.append(f"cores used by each worker while the others were measured: {busy}")
    lines.append(f"waited {report['settle_s']:.1f} s in all for every worker to be quiet")
    return "\n".join(lines)


# ---- running the workers ------------------------------------------------------------------


def worker_argv(spec: WorkerSpec, port: int, args: argparse.Namespace) -> list[str]:
    """`dflash-worker` for one worker: the bundled pair (or target alone), as a user runs it."""
    argv = [sys.executable, "-m", "engine.worker.cli"]
    if spec.backend == "vllm":
        argv += ["--backend", "vllm"]
        if args.vllm_bin:
            argv += ["--vllm-bin", args.vllm_bin]
    argv += ["--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--served-model-name", MODEL_NAME, "--max-num-seqs", str(max(args.concurrency))]
    argv += ["--max-model-len", str(args.max_model_len), "--seed", "0"]
    if spec.mode == "plain":
        argv.append("--no-speculation")
    elif spec.backend == "embedded":
        # vLLM's policy on both backends (num_speculative_tokens drafts every step), so the
        # two engines are compared at the same speculation; `dflash-bench engine --adaptive`
        # measures the embedded worker's default, adaptive.
        argv += ["--speculation", "fixed"]
    if spec.backend == "vllm" and spec.mode == "plain":
        # Real vLLM refuses per-request speculation metrics without a speculative config,
        # and dflash-worker asks for them by default (`summary`).
        argv += ["--per-request-spec-decode-metrics", "none"]
    if spec.backend == "vllm":
        argv += list(args.vllm_arg)
    return argv


def worker_env(spec: WorkerSpec, threads: int) -> dict[str, str]:
    """Both backends get the same cores: `threads` OpenMP threads (0: each backend's own
    default; vLLM's CPU build then binds all but one core)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)
        if spec.backend == "vllm":
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
    if spec.backend == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", VLLM_KV_GIB)
    return env


@dataclass
class RunningWorker:
    spec: WorkerSpec
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    startup_s: float = 0.0


@contextlib.contextmanager
def running_workers(
    specs: Sequence[WorkerSpec],
    args: argparse.Namespace,
    log_dir: Path,
    argv: Callable[[WorkerSpec, int, argparse.Namespace], list[str]] = worker_argv,
    env: Callable[[WorkerSpec, int], dict[str, str]] = worker_env,
    together: bool = False,
    cwd: Callable[[WorkerSpec], Path] = lambda spec: REPO,
) -> Iterator[list[RunningWorker]]:
    """Start the workers one at a time (a vLLM start takes both cores for a minute), or all
    at the same moment (`together`: each start then has the others' as a neighbour), keep
    them all up, stop them all at the end. `argv`/`env`: each worker's command line and
    environment (from its spec, port and the options; from its spec and --threads); `cwd`:
    the checkout each one runs from (`python -m` imports from there first)."""
    workers: list[RunningWorker] = []
    try:
        for i, spec in enumerate(specs):
            workers.append(_launch(spec, i, args, log_dir, argv, env, cwd(spec)))
            if not together:
                _await_ready(workers[-1], args)
        for worker in workers if together else ():
            _await_ready(worker, args)
        yield workers
    finally:
        for worker in workers:
            stop(worker.process, timeout=60)


def _launch(
    spec: WorkerSpec,
    i: int,
    args: argparse.Namespace,
    log_dir: Path,
    argv: Callable[[WorkerSpec, int, argparse.Namespace], list[str]],
    env: Callable[[WorkerSpec, int], dict[str, str]],
    cwd: Path,
) -> RunningWorker:
    port = args.port_base + i if args.port_base else free_port()
    log_path = log_dir / f"{spec.name}.log"
    print(f"starting {spec.name} on port {port} (log {log_path})", flush=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv(spec, port, args),
            cwd=cwd,
            env=env(spec, args.threads),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return RunningWorker(spec, f"http://127.0.0.1:{port}", process, log_path)


def _await_ready(worker: RunningWorker, args: argparse.Namespace) -> None:
    name = worker.spec.name
    worker.startup_s = wait_healthy(
        f"{worker.url}/health",
        worker.process,
        args.startup_timeout,
        name=name,
        log=worker.log_path,
        report_every=15.0,
        interval=0.5,
    )
    print(f"  {name}: ready after {worker.startup_s:.0f} s", flush=True)


# ---- load -----------------------------------------------------------------------------------


async def one_request(
    client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int
) -> RequestResult | None:
    payload = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    start = time.perf_counter()
    try:
        response = await client.post(f"{url}/v1/completions", json=payload)
    except httpx.HTTPError as exc:
        print(f"  request to {url} failed: {exc!r}", file=sys.stderr)
        return None
    latency = time.perf_counter() - start
    if response.status_code != 200:
        print(f"  {url}: HTTP {response.status_code}: {response.text[:300]}", file=sys.stderr)
        return None
    return parse_result(response.json(), latency)


async def run_round(
    client: httpx.AsyncClient, url: str, prompts: Sequence[str], concurrency: int, max_tokens: int
) -> tuple[list[RequestResult | None], float]:
    """Closed loop: `concurrency` requests in flight until every prompt has been served."""

    async def send(i: int) -> RequestResult | None:
        return await one_request(client, url, prompts[i], max_tokens)

    return await closed_loop(len(prompts), concurrency, send)


@dataclass
class Idle:
    """CPU that the workers not being measured used meanwhile: they should use none, or
    the rounds alternating between live workers would not measure one worker at a time."""

    cpu_s: dict[str, float] = field(default_factory=dict)
    wall_s: dict[str, float] = field(default_factory=dict)  # others' rounds, summed
    settle_s: float = 0.0  # waited before rounds for every worker to be quiet

    def fractions(self) -> dict[str, float]:
        """Cores busy on average while idle (1.0 = one core fully busy)."""
        return {k: self.cpu_s[k] / w if w > 0 else 0.0 for k, w in self.wall_s.items()}


QUIET_CORES = 0.1  # a worker using less than this (cores, over a 0.25 s window) is quiet
SETTLE_LIMIT_S = 10.0


async def settle(workers: Sequence[RunningWorker]) -> float:
    """Wait (bounded) until no worker uses CPU: vLLM keeps about one core busy polling for
    about a second after its last request, which would slow whichever worker runs next."""
    start = time.perf_counter()
    while time.perf_counter() - start < SETTLE_LIMIT_S:
        before = [cpu_seconds(w.process.pid) for w in workers]
        window = time.perf_counter()
        await asyncio.sleep(0.25)
        elapsed = time.perf_counter() - window
        after = [cpu_seconds(w.process.pid) for w in workers]
        if all((b - a) / elapsed < QUIET_CORES for a, b in zip(before, after, strict=True)):
            break
    return time.perf_counter() - start


async def measure(
    workers: Sequence[RunningWorker], prompts: Sequence[str], args: argparse.Namespace
) -> tuple[dict[tuple[str, int], Cell], Idle]:
    """Warm every worker, then `--rounds` rounds: in each, every concurrency, and at each
    concurrency every worker once, in an order that changes from round to round."""
    cells = {(w.spec.name, c): Cell(w.spec.name, c) for w in workers for c in args.concurrency}
    idle = Idle({w.spec.name: 0.0 for w in workers}, {w.spec.name: 0.0 for w in workers})
    timeout = httpx.Timeout(args.request_timeout)
    limits = httpx.Limits(max_connections=max(args.concurrency) * 2)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        for w in workers:  # first-call allocations and batch shapes out of the timing
            for c in args.concurrency:
                await run_round(client, w.url, prompts[:c], c, min(8, args.max_tokens))
        for r in range(args.rounds):
            for c in args.concurrency:
                batch = [prompts[i % len(prompts)] for i in range(_round_size(c, args))]
                for w in round_order(workers, r):
                    cell = cells[(w.spec.name, c)]
                    await _measured_round(client, w, workers, batch, cell, idle, args)
                    print(
                        f"  round {r + 1}/{args.rounds} c={c} {w.spec.name}: "
                        f"{cell.runs_tokens_per_second[-1]:.1f} tok/s",
                        flush=True,
                    )
    return cells, idle


async def _measured_round(
    client: httpx.AsyncClient,
    worker: RunningWorker,
    workers: Sequence[RunningWorker],
    batch: Sequence[str],
    cell: Cell,
    idle: Idle,
    args: argparse.Namespace,
) -> None:
    idle.settle_s += await settle(workers)
    others = [w for w in workers if w is not worker]
    cpu_before = {w.spec.name: cpu_seconds(w.process.pid) for w in workers}
    results, seconds = await run_round(client, worker.url, batch, cell.concurrency, args.max_tokens)
    cell.cpu_s += cpu_seconds(worker.process.pid) - cpu_before[worker.spec.name]
    for w in others:
        idle.cpu_s[w.spec.name] += cpu_seconds(w.process.pid) - cpu_before[w.spec.name]
        idle.wall_s[w.spec.name] += seconds
    cell.add_round(results, seconds)
    for i, res in enumerate(results[: args.num_prompts]):
        if res is not None:
            cell.texts.setdefault(i, res.text)


def _round_size(concurrency: int, args: argparse.Namespace) -> int:
    return max(int(args.num_prompts), concurrency * int(args.requests_per_slot))


# ---- command line ---------------------------------------------------------------------------


def _name_list(allowed: Sequence[str]) -> Any:
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in allowed]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"expected a list of {','.join(allowed)}: {text!r}")
        return values

    return parse


# Full run / --quick (the test's): used for every option left unset.
DEFAULTS = {
    "rounds": (3, 1),
    "max_tokens": (96, 8),
    "num_prompts": (8, 2),
    "concurrency": ([1, 8], [1, 2]),
    "requests_per_slot": (2, 1),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-bench backends", description=__doc__.split("\n")[0])
    p.add_argument("--backends", type=_name_list(BACKENDS), default=list(BACKENDS))
    p.add_argument("--modes", type=_name_list(MODES), default=list(MODES))
    p.add_argument("--concurrency", type=int_list, default=None, help="default 1,8")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3)")
    p.add_argument("--max-tokens", type=int, default=None, help="per request (default 96)")
    p.add_argument("--num-prompts", type=int, default=None, help="held-out prompts (default 8)")
    p.add_argument(
        "--requests-per-slot",
        type=int,
        default=None,
        help="requests per round = max(prompts, concurrency x this) (default 2)",
    )
    p.add_argument("--quick", action="store_true", help="tiny run: 1 round, 8 tokens, c=1,2")
    p.add_argument("--dtype", default="float32", help="both backends (default float32)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OpenMP threads per worker, the same for both backends (0 = each one's default)",
    )
    p.add_argument(
        "--vllm-bin", default=os.environ.get("DFLASH_VLLM_BIN"), help="env DFLASH_VLLM_BIN"
    )
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=None,
        help="extra `vllm serve` argument, repeatable (default: --enforce-eager)",
    )
    p.add_argument("--port-base", type=int, default=0, help="ports base..base+3 (default: free)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds per worker")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--log-dir", type=Path, default=None, help="worker logs (default: a temp dir)")
    p.add_argument("--json", type=Path, default=Path("bench-results/backends.json"))
    return p


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    args = build_parser().parse_args(list(argv))
    for name, (full, quick) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.vllm_arg is None:
        args.vllm_arg = ["--enforce-eager"]  # torch.compile would add minutes per start
    for name in ("rounds", "max_tokens", "num_prompts", "requests_per_slot"):
        if getattr(args, name) < 1:
            build_parser().error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def worker_specs(args: argparse.Namespace) -> list[WorkerSpec]:
    # Embedded plain first: the greedy oracle the other workers' texts are compared with.
    return [WorkerSpec(b, m) for b in args.backends for m in args.modes]


def check_vllm(args: argparse.Namespace) -> str | None:
    """Why real vLLM cannot be started, or None (checked before anything starts)."""
    if "vllm" not in args.backends:
        return None
    from engine.worker.settings import ConfigError
    from engine.worker.vllm_backend import find_vllm

    try:
        find_vllm(args.vllm_bin)
    except ConfigError as exc:
        return str(exc)
    return None


def build_report(
    args: argparse.Namespace,
    workers: Sequence[RunningWorker],
    cells: dict[tuple[str, int], Cell],
    rss: dict[str, float],
    load: tuple[list[float], list[float]],
    idle: Idle,
) -> dict[str, Any]:
    specs = [w.spec for w in workers]
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    return {
        "benchmark": "backends",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "model": MODEL_NAME,
        "config": config,
        "workers": {
            w.spec.name: {"argv": worker_argv(w.spec, 0, args)[1:], "startup_s": w.startup_s}
            for w in workers
        },
        "workers_rss_mib": rss,
        "workers_idle_cores": idle.fractions(),
        "settle_s": idle.settle_s,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_before": load[0],
            "load_average_after": load[1],
        },
        "results": build_results(cells, specs, args.concurrency),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    problem = check_vllm(args)
    if problem is not None:
        print(f"dflash-bench backends: {problem}", file=sys.stderr)
        return 2
    from engine.train.corpus import heldout_prompts

    prompts = heldout_prompts(args.num_prompts)
    with contextlib.ExitStack() as stack:
        log_dir = args.log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        log_dir.mkdir(parents=True, exist_ok=True)
        with running_workers(worker_specs(args), args, log_dir) as workers:
            rss = {w.spec.name: rss_mib(w.process.pid) for w in workers}
            load_before = list(os.getloadavg())
            cells, idle = asyncio.run(measure(workers, prompts, args))
            rss = {w.spec.name: max(rss[w.spec.name], rss_mib(w.process.pid)) for w in workers}
            load = (load_before, list(os.getloadavg()))
            report = build_report(args, workers, cells, rss, load, idle)
    print(format_table(report))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.json}")
    return 1 if any(r["errors"] for r in report["results"]) else 0
