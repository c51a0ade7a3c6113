"""`dflash-bench adapt --quick` as CI runs it: one domain through the real capture, adapt and
serving steps (a few requests, a few steps); the JSON's structure and sane values, and the
losslessness count (never speed: a few training steps need not improve anything)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loadtest.adapt_bench import DOMAINS, load_domain, parse_adapt

REPO = Path(__file__).resolve().parents[2]


def test_quick_mode_runs_the_flywheel_on_one_domain(tmp_path: Path) -> None:
    out = tmp_path / "adapt.json"
    argv = [sys.executable, "-m", "loadtest.bench", "adapt", "--quick", "--domains", "prose"]
    argv += ["--out", str(out), "--work-dir", str(tmp_path / "work")]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "| prose |" in done.stdout and "worst domain:" in done.stdout

    report = json.loads(out.read_text())
    assert report["benchmark"] == "adapt" and report["quick"] is True
    (row,) = report["domains"]
    assert row["domain"] == "prose"
    assert row["capture"]["requests_ok"] == row["capture"]["requests_sent"] == 12
    assert row["capture"]["shards"] >= 1
    adapt = row["adapt"]
    assert adapt["steps"] == 6 and adapt["heldout_requests"] >= 1
    for key in ("traffic_before", "traffic_after", "recipe_before", "recipe_after"):
        assert 1.0 <= adapt[key] <= 16.0
    serving = row["serving"]
    assert serving["tokens_per_s"]["old"] > 0 and serving["tokens_per_s"]["new"] > 0
    for temperature in ("acceptance_t0", "acceptance_t07"):
        assert all(1.0 <= v <= 16.0 for v in serving[temperature].values())
    # DFlash is lossless: greedy text equals plain decoding's, whichever drafter drafts.
    assert serving["mismatches_vs_plain"] == {"old": 0, "new": 0}
    assert report["worst"]["mismatches"] == 0


def test_held_out_prompts_are_never_captured_and_every_domain_has_enough() -> None:
    for name in DOMAINS:
        domain = load_domain(name, 300, 16)
        assert len(set(domain.train)) == 300 and len(set(domain.heldout)) == 16
        assert not set(domain.train) & set(domain.heldout)
        assert domain.endpoint in {"chat", "completions"}


def test_adapt_s_table_is_read_back() -> None:
    printed = (
        "adapt: tau at temperature 0, block 16        before    after\n"
        "  held-out traffic (45 requests)          4.520    7.840\n"
        "  recipe held-out (16 prompts)            4.200      n/a\n"
    )
    assert parse_adapt(printed) == {
        "heldout_requests": 45,
        "traffic_before": 4.52,
        "traffic_after": 7.84,
        "recipe_before": 4.2,
        "recipe_after": None,
    }
