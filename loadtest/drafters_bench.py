"""`dflash-bench drafters`: the bundled DFlash drafter against the bundled DFlash2 drafter, end
to end through HTTP at c = 1 (issue 45's speed goal: DFlash2's tokens/s at least DFlash's).

Two `dflash-worker`s serve the bundled target, one with each drafter (`"method": "dflash"` and
`"method": "dflash2"`), both with the worker's default (adaptive) speculation. The same
held-out code prompts go to both, request by request, the order alternating, greedy, a fixed
number of new tokens (`ignore_eos`). Reported per drafter: tokens/s (completion tokens over
the seconds its requests took), the mean acceptance length the worker reported, and whether
both gave the same text (they must: both are lossless). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from launcher.processes import free_port, stop, wait_healthy
from loadtest.harness import aligned, bench_prompts, git_commit, round_order

ASSETS = Path(__file__).resolve().parents[1] / "engine" / "assets" / "tiny-coder"
DRAFTERS = {"dflash": ("dflash", ASSETS / "dflash"), "dflash2": ("dflash2", ASSETS / "dflash2")}


@contextlib.contextmanager
def workers(args: argparse.Namespace) -> Iterator[dict[str, str]]:
    started: list[subprocess.Popen[bytes]] = []
    urls = {}
    try:
        for name, (method, folder) in DRAFTERS.items():
            port = free_port()
            spec = json.dumps({"method": method, "model": str(folder)})
            argv = [sys.executable, "-m", "engine.worker.cli", "--port", str(port)]
            argv += ["--served-model-name", "tiny-coder", "--speculative-config", spec]
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            process = subprocess.Popen(
                argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            started.append(process)
            urls[name] = f"http://127.0.0.1:{port}"
            wait_healthy(urls[name] + "/health", process, args.startup_timeout)
        yield urls
    finally:
        for process in started:
            stop(process)


def measure(urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    prompts = bench_prompts(None, args.prompts)
    tokens = dict.fromkeys(urls, 0)
    seconds = dict.fromkeys(urls, 0.0)
    lengths: dict[str, list[float]] = {name: [] for name in urls}
    texts: dict[str, list[str]] = {name: [] for name in urls}
    with httpx.Client(timeout=600) as client:
        for url in urls.values():  # warm: first-request costs out of the measurement
            client.post(url + "/v1/completions", json={"model": "tiny-coder", "prompt": "x"})
        for round_ in range(args.rounds):
            for i, prompt in enumerate(prompts):
                for name in round_order(list(urls), i + round_):
                    body = {"model": "tiny-coder", "prompt": prompt, "temperature": 0}
                    body.update(max_tokens=args.max_tokens, ignore_eos=True)
                    started = time.perf_counter()
                    reply = client.post(urls[name] + "/v1/completions", json=body).json()
                    seconds[name] += time.perf_counter() - started
                    tokens[name] += reply["usage"]["completion_tokens"]
                    spec = reply["metrics"].get("speculative_decoding") or {}
                    lengths[name].append(spec.get("mean_acceptance_length", 1.0))
                    if round_ == 0:
                        texts[name].append(reply["choices"][0]["text"])
    rows = {
        name: {
            "tokens_per_s": round(tokens[name] / seconds[name], 1),
            "mean_acceptance_length": round(sum(lengths[name]) / len(lengths[name]), 3),
            "requests": len(lengths[name]),
        }
        for name in urls
    }
    ratio = rows["dflash2"]["tokens_per_s"] / rows["dflash"]["tokens_per_s"]
    return {
        "drafters": rows,
        "dflash2_over_dflash": round(ratio, 3),
        "same_greedy_text": texts["dflash"] == texts["dflash2"],
        "met": ratio >= 1.0 and texts["dflash"] == texts["dflash2"],
    }


def table(result: dict[str, Any]) -> str:
    lines = [["drafter", "tokens/s c=1", "mean acceptance length", "requests"]]
    for name, row in result["drafters"].items():
        lines.append(
            [
                name,
                str(row["tokens_per_s"]),
                str(row["mean_acceptance_length"]),
                str(row["requests"]),
            ]
        )
    lines.append(["dflash2 / dflash", str(result["dflash2_over_dflash"]), "", ""])
    return aligned(lines, " | ") + f"\nsame greedy text: {result['same_greedy_text']}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-bench drafters", description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--quick", action="store_true", help="CI: 2 prompts, 1 round, 8 tokens")
    p.add_argument("--out", type=Path, default=Path("bench-results/drafters.json"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.prompts, args.rounds, args.max_tokens = 2, 1, 8
    with workers(args) as urls:
        result = measure(urls, args)
    print(table(result))
    report = {"benchmark": "drafters", "commit": git_commit(), "config": vars(args), **result}
    report["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0
