"""`dflash-bench backends`: the report's arithmetic on known rounds, a --quick run against
real embedded workers, and (opt-in, DFLASH_BENCH_VLLM=1) a --quick run with real vLLM too.

The vLLM run needs the CPU build of vLLM (`make vllm-env`, or DFLASH_VLLM_BIN) and about
three minutes for two vLLM starts, so it runs only when asked for; speed is never asserted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from loadtest import backends_bench as bb
from loadtest import bench


def _result(
    tokens: int, latency: float, text: str, accept: float | None = None
) -> bb.RequestResult:
    steps = 4 if accept is not None else 0
    accepted = round((accept - 1) * steps) if accept is not None else 0
    return bb.RequestResult(tokens, latency, text, accept, steps, accepted)


def _cells() -> dict[tuple[str, int], bb.Cell]:
    """Two rounds of two requests for embedded plain and DFlash at concurrency 1."""
    plain, dflash = bb.Cell("embedded-plain", 1), bb.Cell("embedded-dflash", 1)
    plain.add_round([_result(10, 1.0, "a"), _result(10, 1.0, "b")], 2.0)  # 10 tok/s
    plain.add_round([_result(10, 0.5, "a"), _result(10, 0.5, "b")], 1.0)  # 20 tok/s
    dflash.add_round([_result(10, 0.25, "a", 3.0), _result(10, 0.25, "x", 5.0)], 0.5)  # 40
    dflash.add_round([_result(10, 0.5, "a", 3.0), None], 0.5)  # 20 tok/s, one error
    for cell in (plain, dflash):
        cell.texts = {0: "a", 1: "b" if cell is plain else "x"}
    dflash.cpu_s = 0.5  # over 1.0 s of rounds
    return {(c.worker, 1): c for c in (plain, dflash)}


def test_rows_carry_speedups_acceptance_and_text_agreement() -> None:
    specs = [bb.WorkerSpec("embedded", "plain"), bb.WorkerSpec("embedded", "dflash")]
    rows = bb.build_results(_cells(), specs, [1])
    plain, dflash = rows
    assert plain["tokens_per_second"] == pytest.approx(40 / 3.0)
    assert plain["mean_acceptance_length"] is None and plain["pooled_acceptance_length"] is None
    assert plain["speedup_vs_plain"] == pytest.approx(1.0)
    assert plain["texts_match_reference"] == "2/2"

    assert dflash["tokens_per_second"] == pytest.approx(30 / 1.0)
    assert dflash["num_requests"] == 4 and dflash["errors"] == 1
    assert dflash["mean_acceptance_length"] == pytest.approx((3 + 5 + 3) / 3)
    assert dflash["pooled_acceptance_length"] == pytest.approx(1 + (8 + 16 + 8) / 12)
    assert dflash["speedup_vs_plain"] == pytest.approx(30 / (40 / 3))
    assert dflash["paired_speedups_vs_plain"] == pytest.approx([4.0, 1.0])
    assert dflash["median_paired_speedup"] == pytest.approx(2.5)
    assert dflash["user_tokens_per_second"] == pytest.approx((40 + 40 + 20) / 3)
    assert dflash["texts_match_reference"] == "1/2"
    assert dflash["cores_used"] == pytest.approx(0.5) and plain["cores_used"] == 0.0


def test_idle_cores_are_cpu_seconds_over_the_others_wall_time() -> None:
    idle = bb.Idle({"vllm-plain": 0.5, "vllm-dflash": 0.0}, {"vllm-plain": 2.0, "vllm-dflash": 0.0})
    assert idle.fractions() == {"vllm-plain": 0.25, "vllm-dflash": 0.0}


def test_parse_result_reads_usage_text_and_speculation() -> None:
    body = {
        "choices": [{"text": "return x"}],
        "usage": {"completion_tokens": 96},
        "metrics": {
            "speculative_decoding": {
                "mean_acceptance_length": 7.0666,
                "num_spec_steps": 15,
                "num_accepted_draft_tokens": 91,
            }
        },
    }
    got = bb.parse_result(body, 0.25)
    assert (got.tokens, got.text, got.spec_steps, got.accepted_draft_tokens) == (
        96,
        "return x",
        15,
        91,
    )
    assert got.acceptance_length == pytest.approx(7.0666)
    plain = bb.parse_result({"choices": [{"text": ""}], "usage": {"completion_tokens": 3}}, 1.0)
    assert plain.acceptance_length is None and plain.spec_steps == 0


def test_workers_start_through_dflash_worker_with_equal_settings() -> None:
    args = bb.parse_args(["--vllm-bin", "/opt/vllm", "--threads", "1"])
    assert args.concurrency == [1, 8] and args.max_tokens == 96 and args.rounds == 3
    vllm = bb.worker_argv(bb.WorkerSpec("vllm", "plain"), 31000, args)
    emb = bb.worker_argv(bb.WorkerSpec("embedded", "dflash"), 31001, args)
    assert vllm[1:3] == ["-m", "engine.worker.cli"] and emb[1:3] == ["-m", "engine.worker.cli"]
    assert vllm[3:7] == ["--backend", "vllm", "--vllm-bin", "/opt/vllm"]
    assert "--no-speculation" in vllm and "--no-speculation" not in emb
    assert emb[emb.index("--speculation") + 1] == "fixed"  # vLLM's policy on both sides
    assert "--speculation" not in vllm
    assert vllm[-1] == "--enforce-eager" and "--enforce-eager" not in emb
    for argv in (vllm, emb):
        assert argv[argv.index("--dtype") + 1] == "float32"
        assert argv[argv.index("--max-num-seqs") + 1] == "8"
    env = bb.worker_env(bb.WorkerSpec("vllm", "dflash"), 1)
    assert env["OMP_NUM_THREADS"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert bb.worker_env(bb.WorkerSpec("embedded", "plain"), 1)["OMP_NUM_THREADS"] == "1"


def test_quick_defaults_and_bad_values() -> None:
    quick = bb.parse_args(["--quick", "--rounds", "2"])
    assert quick.rounds == 2 and quick.max_tokens == 8 and quick.concurrency == [1, 2]
    with pytest.raises(SystemExit):
        bb.parse_args(["--backends", "embedded,tgi"])
    with pytest.raises(SystemExit):
        bb.parse_args(["--max-tokens", "0"])


def test_missing_vllm_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    rc = bb.main(["--quick", "--backends", "vllm", "--vllm-bin", "/nonexistent/vllm"])
    assert rc == 2
    assert "not an executable file" in capsys.readouterr().err


def _check_report(report: dict[str, Any], workers: list[str]) -> None:
    assert report["benchmark"] == "backends" and report["model"] == "tiny-coder"
    assert set(report["workers"]) == set(workers) == set(report["workers_rss_mib"])
    assert set(report["workers_idle_cores"]) == set(workers)
    assert all(v >= 0 for v in report["workers_idle_cores"].values())
    assert report["settle_s"] >= 0 and report["commit"]
    rows = {(r["worker"], r["concurrency"]): r for r in report["results"]}
    assert set(rows) == {(w, c) for w in workers for c in (1, 2)}
    for (worker, c), r in rows.items():
        assert r["errors"] == 0 and r["num_requests"] == max(2, c)  # --quick: 2 prompts
        assert r["generated_tokens"] == 8 * r["num_requests"]  # ignore_eos: exactly max
        assert r["tokens_per_second"] == pytest.approx(r["generated_tokens"] / r["elapsed_s"])
        assert report["workers_rss_mib"][worker] > 0 and r["cores_used"] > 0
        if worker.endswith("-plain"):
            assert r["mean_acceptance_length"] is None
        else:
            assert 1.0 <= r["mean_acceptance_length"] <= 16.0  # bundled drafter: block 16
            assert r["speedup_vs_plain"] is not None
    # Greedy float32: the embedded DFlash worker's text is the plain worker's, prompt by prompt.
    assert rows[("embedded-dflash", 1)]["texts_match_reference"] == "2/2"


def test_quick_run_against_embedded_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(bb.REPO))
    out = tmp_path / "backends.json"
    assert bench.main(["backends", "--quick", "--backends", "embedded", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "embedded-dflash" in table and "accept" in table
    _check_report(json.loads(out.read_text()), ["embedded-plain", "embedded-dflash"])


@pytest.mark.vllm
@pytest.mark.skipif(
    os.environ.get("DFLASH_BENCH_VLLM") != "1",
    reason="opt-in: DFLASH_BENCH_VLLM=1 (starts real vLLM twice, minutes)",
)
def test_quick_run_with_real_vllm(tmp_path: Path) -> None:
    out = tmp_path / "backends.json"
    assert bench.main(["backends", "--quick", "--json", str(out)]) == 0
    names = ["embedded-plain", "embedded-dflash", "vllm-plain", "vllm-dflash"]
    _check_report(json.loads(out.read_text()), names)
