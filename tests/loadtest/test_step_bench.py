"""`dflash-bench step` on a tiny random checkpoint: the JSON's structure and arithmetic
(never its speed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import bench, step_bench
from tests.fixtures.tiny_models import TinyCheckpoint


def test_step_bench_writes_consistent_json(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tiny_checkpoint  # block_size 4
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["def add(a, b):\n", "class Stack:\n    def push(self, x):\n"]))
    out = tmp_path / "step.json"
    argv = [
        "step",
        "--model",
        str(ckpt.target_dir),
        "--drafter",
        str(ckpt.drafter_dir),
        "--prompts",
        str(prompts),
        "--batch-sizes",
        "1,2",
        "--block-sizes",
        "2,4,8",
        "--steps",
        "3",
        "--rounds",
        "2",
        "--run-tokens",
        "8",
        "--json",
        str(out),
    ]
    assert bench.main(argv) == 0
    assert "verify" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["widths"] == [1, 2, 4]  # 8 exceeds the drafter's block: dropped
    columns = report["runs"]["quiet"]["columns"]
    assert [(c["batch_size"], c["width"], c["drafter"]) for c in columns] == [
        (b, w, d) for b in (1, 2) for w, d in ((1, False), (1, True), (2, True), (4, True))
    ]
    for c in columns:
        assert c["steps"] == 6  # 3 steps x 2 rounds
        assert 1.0 <= c["tokens_per_row_step"] <= c["width"]
        assert sum(c["phases_ms"].values()) == pytest.approx(c["cpu_ms_median"], rel=1e-6)
        plain = next(p for p in columns if p["batch_size"] == c["batch_size"] and not p["drafter"])
        assert c["cost_plain_steps"] == pytest.approx(c["cpu_ms_median"] / plain["cpu_ms_median"])
        assert c["speedup_bound"] == pytest.approx(c["tokens_per_row_step"] / c["cost_plain_steps"])
        if c["width"] == 1:
            assert c["phases_ms"]["draft"] < 0.05 * c["cpu_ms_median"]
            assert c["tokens_per_row_step"] == 1.0
        else:
            assert c["phases_ms"]["draft"] > 0.0


def test_missing_checkpoint_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert step_bench.main(["--model", str(tmp_path / "x"), "--drafter", str(tmp_path)]) == 2
    assert "no target checkpoint" in capsys.readouterr().err
