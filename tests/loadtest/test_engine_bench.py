"""`dflash-bench engine` on a tiny random checkpoint: the JSON's structure and arithmetic
(never its speed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import bench, engine_bench
from tests.fixtures.tiny_models import TinyCheckpoint


def test_engine_bench_writes_consistent_json(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tiny_checkpoint  # block_size 4
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["def add(a, b):\n", "class Stack:\n    def push(self, x):\n"]))
    out = tmp_path / "engine.json"
    argv = [
        "engine",
        "--model",
        str(ckpt.target_dir),
        "--drafter",
        str(ckpt.drafter_dir),
        "--concurrency",
        "1,2",
        "--max-tokens",
        "6",
        "--prompts",
        str(prompts),
        "--repeats",
        "2",
        "--max-model-len",
        "256",
        "--json",
        str(out),
    ]
    assert bench.main(argv) == 0
    table = capsys.readouterr().out
    assert "tok/s" in table and "accept len" in table and "host ms/tok" in table

    report = json.loads(out.read_text())
    assert report["block_sizes"] == [1, 4] and report["concurrency"] == [1, 2]
    assert report["outputs_match"] is True  # greedy DFlash == greedy plain
    cells = {(r["concurrency"], r["block_size"]): r for r in report["results"]}
    assert set(cells) == {(1, 1), (1, 4), (2, 1), (2, 4)}
    for (c, b), r in cells.items():
        assert r["num_requests"] == 2 * max(2, 2 * c)  # 2 repeats
        assert r["generated_tokens"] == 6 * r["num_requests"]  # ignore_eos: exactly max
        assert len(r["runs_tokens_per_second"]) == 2
        assert r["tokens_per_second"] == pytest.approx(r["generated_tokens"] / r["elapsed_s"])
        base = cells[(c, 1)]["tokens_per_second"]
        assert r["speedup_vs_block_size_1"] == pytest.approx(r["tokens_per_second"] / base)
        runs, base_runs = r["runs_tokens_per_second"], cells[(c, 1)]["runs_tokens_per_second"]
        paired = [a / b for a, b in zip(runs, base_runs, strict=True)]
        assert r["paired_speedups"] == pytest.approx(paired)
        assert r["median_paired_speedup"] == pytest.approx(sum(paired) / 2)  # 2 repeats
        # The forwards are a part of the time, not all of it: the rest, a token, is host time.
        assert 0 < r["forward_s"] < r["elapsed_s"]
        host = (r["elapsed_s"] - r["forward_s"]) / r["generated_tokens"] * 1e3
        assert r["host_ms_per_token"] == pytest.approx(host)
        if b == 1:
            assert r["num_drafts"] == 0 and r["mean_acceptance_length"] == 1.0
        else:
            assert r["num_draft_tokens"] == 3 * r["num_drafts"] > 0
            assert r["mean_acceptance_length"] == pytest.approx(
                1 + r["num_accepted_tokens"] / r["num_drafts"]
            )
            assert 1.0 <= r["mean_acceptance_length"] <= 4.0


def test_missing_checkpoint_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = engine_bench.main(["--model", str(tmp_path / "nope"), "--drafter", str(tmp_path)])
    assert rc == 2
    assert "no target checkpoint" in capsys.readouterr().err


def test_bad_lists_are_usage_errors() -> None:
    with pytest.raises(SystemExit):
        engine_bench.parse_args(["--concurrency", "0,2"])


def _two_prompt_argv(
    ckpt: TinyCheckpoint, tmp_path: Path, out: Path, repeats: str, *variants: str
) -> list[str]:
    """The engine bench on two short prompts, c = 1 and 2, six tokens, with `variants`."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["def add(a, b):\n", "class Stack:\n"]))
    model = ["--model", str(ckpt.target_dir), "--drafter", str(ckpt.drafter_dir)]
    sizes = ["--concurrency", "1,2", "--max-tokens", "6", "--max-model-len", "128"]
    rounds = ["--prompts", str(prompts), "--repeats", repeats]
    return [*model, *sizes, *rounds, *variants, "--json", str(out)]


def test_adaptive_and_int8_variants_are_exact_and_report_their_choices(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path
) -> None:
    out = tmp_path / "engine.json"
    argv = _two_prompt_argv(tiny_checkpoint, tmp_path, out, "1", "--adaptive", "--drafter-int8")
    assert engine_bench.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["outputs_match"] is True and report["adaptive"] is True
    adaptive = [r for r in report["results"] if r["adaptive"]]
    assert [(r["concurrency"], r["block_size"]) for r in adaptive] == [
        (1, 4),
        (1, 4),
        (2, 4),
        (2, 4),
    ]
    variants = {(r["block_size"], r["adaptive"], r["drafter_int8"]) for r in report["results"]}
    assert variants == {
        (1, False, False),
        (4, False, False),
        (4, True, False),
        (4, False, True),
        (4, True, True),
    }
    assert report["block_sizes"] == [1, 4] and report["drafter_int8"] is True
    for r in adaptive:
        assert 0.0 <= r["mean_draft_tokens_per_step"] <= 3.0
        assert r["generated_tokens"] == 6 * r["num_requests"]
    assert set(report["adaptive_table"]) == {"1", "2", "4", "8", "16"}
    assert all(0 <= k <= 3 for k in report["adaptive_table"].values())
    assert len(report["adaptive_rates"]) == 3


def test_forced_plain_never_drafts_and_has_its_plain_control(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "engine.json"
    argv = _two_prompt_argv(tiny_checkpoint, tmp_path, out, "2", "--forced-plain")
    assert engine_bench.main(argv) == 0
    table = capsys.readouterr().out
    assert "    4ap " in table and "    1c " in table  # the tiny drafter's block is 4
    report = json.loads(out.read_text())
    assert report["outputs_match"] is True and report["forced_plain"] is True
    assert report["block_sizes"] == [1, 4]
    kinds = {
        (r["block_size"], r["adaptive"], r["forced_plain"], r["control"]) for r in report["results"]
    }
    assert kinds == {
        (1, False, False, False),
        (4, False, False, False),
        (4, True, True, False),
        (1, False, False, True),
    }
    for r in report["results"]:
        if r["forced_plain"] or r["control"]:
            # it planned, and decoded every token plain
            assert r["num_drafts"] == 0 and r["num_draft_tokens"] == 0
            assert r["generated_tokens"] == 6 * r["num_requests"]
            assert len(r["paired_speedups"]) == 2 and r["median_paired_speedup"] > 0
    assert "adaptive_table" not in report  # a forced-plain engine's choices are not its plan


def test_a_forced_plain_planner_plans_plain_by_its_own_rules() -> None:
    """ForcedPlain: the planner finds nothing worth drafting, so it keeps its plain plan
    while the batch stays the same (as a worker's does when drafting does not pay), rather
    than weighing the batch again at every step, and a look it takes is decoded plain."""
    from engine.adaptive import CostModel, SpecPolicy
    from engine.row_speculation import REPLAN_EVERY, BandPriors, RowPlanner, StepPlan

    costs = CostModel((1, 4), (0, 3), ((1.0, 1.01), (1.2, 1.21)))  # drafting all but free
    planner = RowPlanner(SpecPolicy(costs, 3, explore_every=2), BandPriors(3))
    keys = ["a", "b"]
    for key in keys:
        planner.add(key, 0.0)
    assert planner.plan(keys, [10, 10], lambda i: 0, [50, 50]).any_drafting  # it would draft
    forced = engine_bench.ForcedPlain(planner)
    fresh = 0
    for step in range(3 * REPLAN_EVERY):
        assert forced.plan(keys, [11 + step] * 2, lambda i: 0, [50, 50]) == StepPlan.plain(2)
        planner.observe(keys, [0.0, 0.0], [(0, 0), (0, 0)])
        kept = planner._kept
        assert kept is not None and kept[1] == StepPlan.plain(2)  # a plain plan, kept
        fresh += kept[2] == 0
    assert 1 <= fresh <= 4  # weighed again only when the kept plan ran out
