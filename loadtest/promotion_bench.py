"""`dflash-bench promotion`: automatic promotion (docs/gateway.md) on live pools of embedded
workers: better canaries, a worse one and an identical one, each against its baseline.

Each scenario starts a fresh gateway whose pools file puts one canary beside a baseline pool,
with `promotion: {baseline: base}` (the defaults: stages 10/25/50/100, 50 samples a stage,
alpha 0.05). The baseline is a DFlash worker with the bundled drafter, except where noted:
- better: the bundled DFlash2 drafter (1.31x DFlash's tokens/s at c = 1, `dflash-bench
  drafters`; per request on this stream of prompts, 1.04x: a difference the test is not meant
  to call in 200 samples);
- worse: plain decoding (`--no-speculation`), slower on greedy code;
- identical: a second worker with the baseline's own drafter;
- speculation-on: a plain baseline and a DFlash canary, as a deployment that turns
  speculation on through a canary.

The traffic is greedy prompts (loadtest/prompts/mix.jsonl) in a seeded random order, sent
one at a time: every request runs alone on its worker, so the two pools are compared at the
same load. (Under a steady load, a canary at 10 % of the traffic runs in
smaller batches than its baseline, and on an engine whose per-request speed falls with the
batch, each of its requests is faster for that alone; docs/gateway.md says so.) A scenario
ends when the canary is promoted to 100 % or rolled back, or after `--max-requests`. Reported:
the requests until each decision, the final weights, and client errors. Goals (issue 47): a
better canary at 100 % within 2,000 requests with no client error, the worse one rolled back
within 1,000; the identical one is reported (its false-promotion rate is a replay test's:
tests/service/routing/test_promotion.py). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import sys
import tempfile
import time
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
from loadtest.fleet_bench import REPO, add_worker_options, pool_cores, stream_prompts
from loadtest.gateway_peers import start_gateway
from loadtest.harness import aligned, git_commit, pinned
from loadtest.speedup_bench import worker_argv

# scenario: (the baseline worker's mode, the canary's) (speedup_bench.worker_argv;
# "identical" gets the worker's defaults, as "dflash" does)
SCENARIOS = {
    "better": ("dflash", "dflash2"),
    "worse": ("dflash", "plain"),
    "identical": ("dflash", "identical"),
    # A plain deployment trying speculation as a canary: better by far on greedy code.
    "speculation-on": ("plain", "dflash"),
}
GOALS = {
    "better": ("promoted", 2000),
    "worse": ("rolled_back", 1000),
    "speculation-on": ("promoted", 2000),
}


@dataclass
class Scenario:
    name: str
    requests: int = 0
    errors: int = 0
    seconds: float = 0.0
    status: str = "testing"
    weights: dict[str, float] = field(default_factory=dict)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)  # the rollout's, at the end
    # (requests sent, canary weight) each time the weight moved
    moves: list[tuple[int, float]] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        goal = GOALS.get(self.name)
        met = None
        if goal is not None:
            wanted, within = goal
            met = self.status == wanted and self.requests <= within and self.errors == 0
        return {
            "scenario": self.name,
            "baseline": SCENARIOS[self.name][0],
            "canary": SCENARIOS[self.name][1],
            "status": self.status,
            "requests": self.requests,
            "errors": self.errors,
            "seconds": round(self.seconds, 1),
            "weights": self.weights,
            "moves": self.moves,
            "decisions": self.decisions,
            "evidence": self.evidence,
            "goal": None if goal is None else f"{goal[0]} within {goal[1]}",
            "met": met,
        }


def pools_file(path: Path, base: str, canary: str) -> Path:
    pools = [
        {"name": "base", "model": MODEL_NAME, "engine": "embedded", "workers": [base]},
        {
            "name": "canary",
            "model": MODEL_NAME,
            "engine": "embedded",
            "workers": [canary],
            "promotion": {"baseline": "base"},
        },
    ]
    path.write_text(json.dumps(pools))
    return path


@contextlib.contextmanager
def gateway(pools: Path) -> Iterator[str]:
    port = free_port()
    process = start_gateway(port, 0, [], None, REPO, pools)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url + "/ready", process, 60, interval=0.2)
        yield url
    finally:
        stop(process)


def canary_card(client: httpx.Client, url: str) -> dict[str, Any]:
    cards = client.get(url + "/admin/pools").json()["data"]
    return {card["pool"]: card for card in cards}


def run_scenario(name: str, url: str, prompts: Sequence[str], args: argparse.Namespace) -> Scenario:
    """Greedy requests one at a time until the canary's rollout ends or max requests. The
    prompts are drawn at random (seeded): the weighted split is a deterministic rotation, and
    prompts in a fixed order would give the canary a fixed subset of them, whose acceptance
    is not its baseline's."""
    out = Scenario(name)
    draw = random.Random(args.seed)
    started = time.perf_counter()
    last_weight: float | None = None
    with httpx.Client(timeout=300, trust_env=False) as client:
        while out.requests < args.max_requests:
            body = {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": draw.choice(prompts)}],
                "max_tokens": args.max_tokens,
                "temperature": 0.0,
            }
            out.requests += 1
            try:
                reply = client.post(url + "/v1/chat/completions", json=body)
                out.errors += reply.status_code != 200
            except httpx.HTTPError:
                out.errors += 1
            if out.requests % args.poll_every:
                continue
            cards = canary_card(client, url)
            weight = cards["canary"]["weight"]
            if weight != last_weight:
                out.moves.append((out.requests, weight))
                last_weight = weight
            out.status = cards["canary"]["promotion"]["status"]
            if out.status != "testing":
                break
        cards = canary_card(client, url)
    out.seconds = time.perf_counter() - started
    out.status = cards["canary"]["promotion"]["status"]
    out.weights = {pool: card["weight"] for pool, card in cards.items()}
    out.decisions = cards["canary"]["promotion"]["decisions"]
    out.evidence = cards["canary"]["promotion"]["evidence"]
    return out


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        ["scenario", "baseline", "canary", "outcome", "requests", "weight moves", "errors", "goal"]
    ]
    for r in rows:
        moves = " ".join(f"{w:g}@{n}" for n, w in r["moves"]) or "-"
        goal = "-" if r["goal"] is None else f"{r['goal']}: {'met' if r['met'] else 'NOT met'}"
        lines.append(
            [
                r["scenario"],
                r["baseline"],
                r["canary"],
                r["status"],
                str(r["requests"]),
                moves,
                str(r["errors"]),
                goal,
            ]
        )
    return aligned(lines, " | ")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-bench promotion", description=__doc__.split("\n")[0])
    p.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help="comma-separated: " + ", ".join(SCENARIOS),
    )
    p.add_argument("--max-requests", type=int, default=2000, help="per scenario, at most")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--poll-every", type=int, default=10, help="requests between /admin reads")
    p.add_argument("--seed", type=int, default=0, help="of the prompts' random order")
    add_worker_options(p, max_num_seqs=4)  # --pin: the baseline on one core, canaries another
    p.add_argument("--quick", action="store_true", help="a few short requests (CI)")
    p.add_argument("--out", type=Path, default=Path("bench-results/promotion.json"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = [n for n in args.scenarios.split(",") if n]
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown or not names:
        print(f"dflash-bench promotion: no scenario {unknown or names}", file=sys.stderr)
        return 2
    if args.quick:
        args.max_requests, args.max_tokens, args.poll_every = 6, 4, 3
    modes = dict.fromkeys(mode for n in names for mode in SCENARIOS[n])  # each worker once
    specs = [WorkerSpec("embedded", mode) for mode in modes]
    cores = pool_cores(args.pin)  # {"dflash": first core, "plain": second core}

    def pinned_argv(spec: WorkerSpec, port: int, options: argparse.Namespace) -> list[str]:
        core = cores.get("dflash" if spec.mode == "dflash" else "plain")
        return pinned(core, worker_argv(spec, port, options))

    prompts = stream_prompts()
    rows = []
    with tempfile.TemporaryDirectory(prefix="dflash-promotion-") as tmp:
        workdir = Path(tmp)
        with running_workers(specs, args, workdir, pinned_argv, worker_env) as workers:
            by_mode: dict[str, RunningWorker] = {w.spec.mode: w for w in workers}
            for name in names:
                base, canary = (by_mode[mode].url for mode in SCENARIOS[name])
                pools = pools_file(workdir / f"{name}.json", base, canary)
                with gateway(pools) as url:
                    rows.append(run_scenario(name, url, prompts, args).row())
                print(table(rows[-1:]), flush=True)
    print(table(rows))
    report = {
        "benchmark": "promotion",
        "commit": git_commit(),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "rows": rows,
        "met": all(r["met"] is not False for r in rows),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
