"""`make gpu-bench` in --quick mode on the CPU, as CI runs it so the GPU command cannot rot:
from the source tree, with the web stack unimportable (the GPU machine has no pydantic, no
fastapi); the JSON's structure and sane values (never its speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from loadtest import engine_bench, gpu_bench

REPO = Path(__file__).resolve().parents[2]
# Imported first by the bench's python (a sitecustomize on PYTHONPATH): a finder that makes
# the packages the GPU machine lacks unimportable, and a mark that it was installed.
BLOCKER = """
import os, sys

BLOCKED = {"pydantic", "pydantic_core", "pydantic_settings", "fastapi", "starlette", "uvicorn"}


class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImportError(f"{name}: not installed on the GPU machine")
        return None


sys.meta_path.insert(0, Blocked())
with open(os.environ["GPU_BENCH_GUARD"], "w") as mark:
    mark.write("installed")
"""


def test_make_gpu_bench_quick_runs_on_the_cpu_without_the_web_stack(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    guard, out = tmp_path / "guard", tmp_path / "gpu.json"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "GPU_BENCH_GUARD": str(guard)}
    argv = ["make", "--no-print-directory", "gpu-bench", f"PYTHON={sys.executable}"]
    argv += [f"OUT_JSON={out}", "GPU_BENCH_ARGS=--quick --device cpu"]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert guard.read_text() == "installed"
    assert "ratio" in done.stdout and "step profile" in done.stdout, done.stdout

    report = json.loads(out.read_text())
    assert report["benchmark"] == "gpu" and report["quick"] is True
    assert report["device"] == "cpu" and report["device_name"]
    assert report["torch"] == torch.__version__
    assert report["dtype"] == "float32" and report["dtype_defaulted"] is True
    assert report["complete"] is True and report["adaptive"] is True
    assert report["commit"] is None or len(report["commit"]) == 40
    block = report["block_size"]
    rows = {(r["shape"], r["concurrency"], r["variant"]): r for r in report["speedup"]}
    shapes = ("greedy", "mixed")
    variants = ("dflash", "adaptive", "forced plain", "plain A/A")
    assert set(rows) == {(s, c, v) for s in shapes for c in (1, 2) for v in variants}
    assert report["forced_plain"] is True
    for (_, _, variant), r in rows.items():
        if variant in ("forced plain", "plain A/A"):  # neither drafts
            assert r["acceptance_length"] == 1.0 and r["draft_tokens_per_step"] == 0.0
    for r in rows.values():
        assert r["plain_tokens_per_second"] > 0 and r["dflash_tokens_per_second"] > 0
        assert r["ratio"] > 0 and r["median_paired_ratio"] > 0
        assert 1.0 <= r["acceptance_length"] <= block
    greedy, mixed = report["shapes"]["greedy"], report["shapes"]["mixed"]
    assert greedy["outputs_match"] is True and greedy["greedy_requests_compared"] > 0
    assert mixed["mix"] == "mixed" and mixed["greedy_requests_compared"] > 0
    # seeded sampled requests: the same text whatever the engine drafts (on the CPU, exactly)
    assert mixed["seeded_requests_compared"] > 0
    assert mixed["seeded_requests_matched"] == mixed["seeded_requests_compared"]
    assert greedy["seeded_requests_compared"] == 0
    assert {(r["batch_size"], r["width"]) for r in report["step_summary"]} == {(1, 16), (2, 16)}
    for r in report["step_summary"]:
        assert r["plain_ms"] > 0 and r["cost_plain_steps"] > 0
        assert 1.0 <= r["tokens_per_row_step"] <= r["width"] and r["speedup_bound"] > 0


def test_mixed_requests_interleave_greedy_and_seeded_samples() -> None:
    params = [engine_bench.request_params(i, 8, "mixed") for i in range(8)]
    assert [p.temperature for p in params] == [0.0, 1.0] * 4
    assert [p.seed for p in params] == [None, None, None, 3, None, None, None, 7]
    assert all(p.max_tokens == 8 and p.ignore_eos for p in params)
    assert {engine_bench.request_params(i, 8).temperature for i in range(4)} == {0.0}


def test_quick_sizes_and_the_cpu_dtype() -> None:
    args = gpu_bench.parse_args(["--quick", "--device", "cpu"])
    assert args.concurrency == [1, 2] and args.shapes == ["greedy", "mixed"]
    assert gpu_bench.resolve_device(args) is None and args.dtype == "float32"
    full = gpu_bench.parse_args(["--concurrency", "4", "--shapes", "mixed"])
    assert full.concurrency == [4] and full.max_tokens == gpu_bench.SIZES["max_tokens"][0]
