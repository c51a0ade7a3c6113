"""`dflash-bench adapt`: does the drafter learn its traffic? The flywheel, end to end, per
traffic domain the bundled drafter never saw (it was trained on Python stdlib code):

1. `dflash-serve --capture DIR` serves the bundled pair; the domain's requests go through its
   OpenAI-compatible HTTP API (4 at a time, temperature 0 and 0.7 alternating);
2. `dflash-train adapt --data DIR --out ADAPTED --minutes M` trains on the capture (a recipe
   set is made and cached when runs/train/distill is absent);
3. three `dflash-worker`s on the bundled target: plain, the bundled drafter, ADAPTED. On the
   domain's held-out prompts (never sent in step 1), one request at a time, old and new
   drafter alternating: tokens/s at T = 0 (completion tokens over request time), the mean
   acceptance length the worker reports at T = 0 and at T = 0.7 (seeded, same seed for both),
   and the adapted drafter's greedy text against plain decoding's (lossless: equal).

adapt's own numbers are reported as it printed them: held-out traffic tau at T = 0 before and
after, recipe tau after / before. Prompt sets: loadtest/prompts/adapt-<domain>.json (templates
x fills, shuffled with a fixed seed; the last ones are held out). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from launcher.processes import free_port, stop, wait_healthy
from loadtest.harness import git_commit, round_order

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "loadtest" / "prompts"
DOMAINS = ("javascript", "prose", "json")
MODEL = "tiny-coder"
SEED = 7


# ---- prompt sets ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Domain:
    name: str
    endpoint: str  # chat | completions
    train: list[str]  # prompts sent through the capturing stack
    heldout: list[str]  # never sent there: the serving comparison's prompts


def load_domain(name: str, requests: int, heldout: int) -> Domain:
    spec = json.loads((PROMPTS / f"adapt-{name}.json").read_text())
    prompts = [t.replace("{x}", fill) for t in spec["templates"] for fill in spec["fills"]]
    random.Random(SEED).shuffle(prompts)
    if requests + heldout > len(prompts):
        raise ValueError(f"{name}: {len(prompts)} prompts, {requests} + {heldout} asked for")
    return Domain(name, spec["endpoint"], prompts[:requests], prompts[-heldout:])


def request(
    domain: Domain, prompt: str, max_tokens: int, temperature: float, **extra: Any
) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "temperature": temperature}
    body.update(extra)
    if domain.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


def reply_text(domain: Domain, reply: dict[str, Any]) -> str:
    choice = reply["choices"][0]
    return str(choice["message"]["content"] if domain.endpoint == "chat" else choice["text"])


# ---- 1. capture ---------------------------------------------------------------------------------


def env_one_thread() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


@contextlib.contextmanager
def dflash_serve(capture: Path, log: Path) -> Iterator[str]:
    """`dflash-serve --capture DIR` as a user starts it; Ctrl-C (SIGINT) on exit, which
    writes the last shard. Yields the gateway's base URL."""
    port = free_port()
    argv = [sys.executable, "-m", "launcher.local_stack", "--port", str(port)]
    argv += ["--capture", str(capture), "--log-level", "warning"]
    argv += ["--worker-arg=--max-num-seqs=4", "--worker-arg=--max-model-len=1024"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env_one_thread(), stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{url}/health", proc, 300, name="dflash-serve", log=log)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                stop(proc)


def capture_traffic(domain: Domain, folder: Path, max_tokens: int, log: Path) -> dict[str, Any]:
    """Send the domain's training prompts through a capturing stack: even ones at T = 0, odd
    ones at T = 0.7; 4 in flight. The count of shards and captured requests."""
    start = time.perf_counter()
    with dflash_serve(folder, log) as url, httpx.Client(base_url=url, timeout=300) as client:

        def send(i: int) -> int:
            path, body = request(domain, domain.train[i], max_tokens, 0.0 if i % 2 == 0 else 0.7)
            return client.post(path, json=body).status_code

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(send, range(len(domain.train))))
    shards = sorted(folder.glob("capture-*.jsonl.zst"))
    return {
        "requests_sent": len(codes),
        "requests_ok": sum(code == 200 for code in codes),
        "shards": len(shards),
        "seconds": round(time.perf_counter() - start, 1),
    }


# ---- 2. adapt -----------------------------------------------------------------------------------

ROW = r"\s+([0-9.]+|n/a)\s+([0-9.]+|n/a)"


def _number(text: str) -> float | None:
    return None if text == "n/a" else float(text)


def parse_adapt(stdout: str) -> dict[str, float | None]:
    """tau before/after as `dflash-train adapt` printed them (its report table)."""
    traffic = re.search(r"held-out traffic \((\d+) requests\)" + ROW, stdout)
    recipe = re.search(r"recipe held-out \((\d+) prompts\)" + ROW, stdout)
    if traffic is None:
        raise RuntimeError(f"dflash-train adapt printed no tau table:\n{stdout[-2000:]}")
    out: dict[str, float | None] = {
        "heldout_requests": int(traffic[1]),
        "traffic_before": _number(traffic[2]),
        "traffic_after": _number(traffic[3]),
    }
    out["recipe_before"] = None if recipe is None else _number(recipe[2])
    out["recipe_after"] = None if recipe is None else _number(recipe[3])
    return out


def run_adapt(
    data: Path, out: Path, runs: Path, args: argparse.Namespace, log: Path
) -> dict[str, Any]:
    argv = [sys.executable, "-m", "engine.train.cli", "adapt", "--data", str(data)]
    argv += ["--out", str(out), "--runs-dir", str(runs), "--device", "cpu"]
    argv += ["--minutes", str(args.minutes), "--steps", str(args.steps)]
    argv += ["--recipe-data", str(args.recipe_data), "--recipe-samples", str(args.recipe_samples)]
    argv += ["--eval-prompts", str(args.eval_prompts), "--eval-tokens", str(args.max_tokens)]
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, env=env_one_thread(), capture_output=True, text=True)
    log.write_text(done.stdout + "\n---- stderr\n" + done.stderr)
    if done.returncode not in (0, 3):
        raise RuntimeError(f"dflash-train adapt exited {done.returncode}:\n{done.stderr[-2000:]}")
    result: dict[str, Any] = parse_adapt(done.stdout)
    logs = sorted(runs.glob("*/log.jsonl"), key=lambda p: p.stat().st_mtime)
    last = logs[-1].read_text().strip().splitlines()[-1] if logs else "{}"
    result.update(
        written=done.returncode == 0,
        steps=int(json.loads(last).get("step", -1)) + 1,
        seconds=round(time.perf_counter() - start, 1),
    )
    return result


# ---- 3. serving: old vs new drafter, and plain decoding -----------------------------------------


@contextlib.contextmanager
def worker(log: Path, *flags: str) -> Iterator[httpx.Client]:
    """One `dflash-worker` on the bundled target, one torch thread."""
    port = free_port()
    argv = [sys.executable, "-m", "engine.worker.cli", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--served-model-name", MODEL, "--max-num-seqs", "1", "--max-model-len", "1024"]
    argv += ["--threads", "1", "--seed", "0", *flags]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env_one_thread(), stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{url}/health", proc, 300, name="dflash-worker", log=log)
        with httpx.Client(base_url=url, timeout=300) as client:
            yield client
    finally:
        stop(proc)


def drafter_flags(drafter: Path) -> tuple[str, ...]:
    return ("--speculative-config", json.dumps({"method": "dflash", "model": str(drafter)}))


@dataclass
class Tally:
    tokens: int = 0
    seconds: float = 0.0
    accepted: list[float] | None = None

    def add(self, reply: dict[str, Any], seconds: float) -> None:
        self.tokens += int(reply["usage"]["completion_tokens"])
        self.seconds += seconds
        spec = (reply.get("metrics") or {}).get("speculative_decoding") or {}
        if spec.get("mean_acceptance_length") is not None:
            self.accepted = [*(self.accepted or []), float(spec["mean_acceptance_length"])]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance(self) -> float | None:
        return sum(self.accepted) / len(self.accepted) if self.accepted else None


def timed(
    client: httpx.Client, domain: Domain, prompt: str, max_tokens: int, temperature: float
) -> tuple[dict[str, Any], float]:
    path, body = request(domain, prompt, max_tokens, temperature, seed=SEED, ignore_eos=True)
    start = time.perf_counter()
    reply = client.post(path, json=body)
    seconds = time.perf_counter() - start
    reply.raise_for_status()
    return reply.json(), seconds


def compare_serving(
    domain: Domain, adapted: Path, bundled: Path, max_tokens: int, logs: Path
) -> dict[str, Any]:
    """Old and new drafter side by side (alternating, the order turning each prompt) and plain
    decoding, on the domain's held-out prompts, one request at a time."""
    t0 = {"old": Tally(), "new": Tally()}
    t7 = {"old": Tally(), "new": Tally()}
    greedy: dict[str, list[str]] = {"old": [], "new": [], "plain": []}
    with (
        worker(logs / f"{domain.name}-old.log", *drafter_flags(bundled)) as old,
        worker(logs / f"{domain.name}-new.log", *drafter_flags(adapted)) as new,
        worker(logs / f"{domain.name}-plain.log", "--no-speculation") as plain,
    ):
        clients = {"old": old, "new": new}
        for client in (old, new, plain):  # warm each one up
            timed(client, domain, domain.heldout[0], 8, 0.0)
        for i, prompt in enumerate(domain.heldout):
            for name in round_order(("old", "new"), i):
                reply, seconds = timed(clients[name], domain, prompt, max_tokens, 0.0)
                t0[name].add(reply, seconds)
                greedy[name].append(reply_text(domain, reply))
                reply, seconds = timed(clients[name], domain, prompt, max_tokens, 0.7)
                t7[name].add(reply, seconds)
            reply, _ = timed(plain, domain, prompt, max_tokens, 0.0)
            greedy["plain"].append(reply_text(domain, reply))
    return {
        "heldout_prompts": len(domain.heldout),
        "tokens_per_s": {k: round(v.tokens_per_s, 1) for k, v in t0.items()},
        "speedup": t0["new"].tokens_per_s / t0["old"].tokens_per_s,
        "acceptance_t0": {k: v.acceptance for k, v in t0.items()},
        "acceptance_t07": {k: v.acceptance for k, v in t7.items()},
        "mismatches_vs_plain": {
            k: sum(a != b for a, b in zip(greedy[k], greedy["plain"], strict=True))
            for k in ("old", "new")
        },
    }


# ---- the benchmark ------------------------------------------------------------------------------


def ratio(new: float | None, old: float | None) -> float | None:
    return None if new is None or old is None or old == 0 else new / old


def run_domain(name: str, args: argparse.Namespace, bundled: Path, work: Path) -> dict[str, Any]:
    domain = load_domain(name, args.requests, args.heldout)
    data, out = work / name / "capture", work / name / "adapted"
    print(f"== {name}: capturing {len(domain.train)} requests", flush=True)
    capture = capture_traffic(domain, data, args.max_tokens, work / f"{name}-serve.log")
    print(f"== {name}: dflash-train adapt ({args.minutes:g} min at most)", flush=True)
    adapt = run_adapt(data, out, work / "runs", args, work / f"{name}-adapt.log")
    drafter = out if adapt["written"] else bundled  # nothing written: the bundled one serves
    print(f"== {name}: serving, old vs new drafter", flush=True)
    serving = compare_serving(domain, drafter, bundled, args.max_tokens, work)
    return {
        "domain": name,
        "capture": capture,
        "adapt": adapt,
        "serving": serving,
        "tau_t0_gain": ratio(adapt["traffic_after"], adapt["traffic_before"]),
        "recipe_kept": ratio(adapt["recipe_after"], adapt["recipe_before"]),
        "acceptance_t07_gain": ratio(
            serving["acceptance_t07"]["new"], serving["acceptance_t07"]["old"]
        ),
    }


def _f(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def table(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        "| domain | captured | steps | held-out tau T=0 before -> after | gain "
        "| accept T=0.7 old -> new | recipe tau after/before | tok/s c=1 old -> new | speed-up "
        "| greedy mismatches (new) |"
    )
    lines = [head, "|" + " --- |" * 10]
    for r in rows:
        a, s = r["adapt"], r["serving"]
        lines.append(
            f"| {r['domain']} | {r['capture']['requests_ok']} | {a['steps']} "
            f"| {_f(a['traffic_before'])} -> {_f(a['traffic_after'])} | {_f(r['tau_t0_gain'])}x "
            f"| {_f(s['acceptance_t07']['old'])} -> {_f(s['acceptance_t07']['new'])} "
            f"| {_f(r['recipe_kept'])} | {s['tokens_per_s']['old']:.1f} -> "
            f"{s['tokens_per_s']['new']:.1f} | {s['speedup']:.2f}x "
            f"| {s['mismatches_vs_plain']['new']}/{s['heldout_prompts']} |"
        )
    return "\n".join(lines)


def worst(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The README-quotable numbers: each measure at its worst domain."""
    return {
        "tau_t0_gain": min((r["tau_t0_gain"] or 0.0) for r in rows),
        "recipe_kept": min((r["recipe_kept"] or 0.0) for r in rows),
        "speedup": min(r["serving"]["speedup"] for r in rows),
        "mismatches": sum(r["serving"]["mismatches_vs_plain"]["new"] for r in rows),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-bench adapt", description=__doc__.split("\n\n")[0])
    p.add_argument("--domains", default=",".join(DOMAINS), help="comma-separated")
    p.add_argument("--requests", type=int, default=300, help="captured per domain (<= 2000)")
    p.add_argument("--heldout", type=int, default=16, help="held-out prompts per domain")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--minutes", type=float, default=15.0, help="adapt training time per domain")
    p.add_argument("--steps", type=int, default=100_000, help="adapt steps at most")
    p.add_argument("--recipe-data", type=Path, default=REPO / "runs" / "train" / "distill")
    p.add_argument("--recipe-samples", type=int, default=256)
    p.add_argument("--eval-prompts", type=int, default=16, help="recipe prompts adapt measures")
    p.add_argument("--quick", action="store_true", help="CI: a few requests, a few steps")
    p.add_argument("--work-dir", type=Path, default=None, help="default: a temporary folder")
    p.add_argument("--out", type=Path, default=Path("bench-results/adapt.json"))
    return p


QUICK = {
    "requests": 12,
    "heldout": 2,
    "max_tokens": 16,
    "minutes": 0.2,
    "steps": 6,
    "recipe_samples": 4,
    "eval_prompts": 2,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if not 1 <= args.requests <= 2000:
        print("dflash-bench adapt: --requests must be 1..2000", file=sys.stderr)
        return 2
    from engine.worker.settings import BUNDLED_DRAFTER

    names = [n for n in args.domains.split(",") if n]
    with contextlib.ExitStack() as stack:
        work = args.work_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        work.mkdir(parents=True, exist_ok=True)
        rows = [run_domain(name, args, Path(BUNDLED_DRAFTER), work) for name in names]
    print()
    print(table(rows))
    summary = worst(rows)
    print(
        f"\nworst domain: held-out tau T=0 x{summary['tau_t0_gain']:.2f}, recipe tau kept "
        f"x{summary['recipe_kept']:.2f}, tokens/s x{summary['speedup']:.2f}, "
        f"{summary['mismatches']} greedy mismatches"
    )
    report = {
        "benchmark": "adapt",
        "quick": args.quick,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "domains": rows,
        "worst": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0
