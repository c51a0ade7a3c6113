"""A tiny smoke run of every stage of `dflash-train` (few files, few steps, tiny sizes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.dflash2 import DFlash2Drafter
from engine.loader import load_drafter, load_target
from engine.train.cli import main


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("train")
    out, runs = root / "out", root / "runs"
    common = [
        "--smoke",
        "--max-files",
        "3",
        "--out-dir",
        str(out),
        "--runs-dir",
        str(runs),
        "--threads",
        "1",
    ]
    for stage in ("tokenizer", "target", "distill", "drafter", "eval"):
        assert main([stage, *common]) == 0, stage
    return out, runs


def test_stages_write_loadable_checkpoints(smoke_run: tuple[Path, Path]) -> None:
    out, _ = smoke_run
    hf = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32)
    target = load_target(out / "target")
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    ours = target(ids, torch.arange(5)[None]).logits
    assert torch.allclose(hf(input_ids=ids).logits, ours, atol=1e-4)
    drafter = load_drafter(out / "dflash", target)
    config = json.loads((out / "dflash" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["mask_token_id"] == 3
    assert drafter.block_size == config["block_size"] == 4


def test_logs_and_eval_report(smoke_run: tuple[Path, Path]) -> None:
    _, runs = smoke_run
    for stage in ("target", "drafter"):
        rows = [json.loads(line) for line in (runs / stage / "log.jsonl").read_text().splitlines()]
        assert rows and all(r["loss"] > 0 for r in rows)
    report = json.loads((runs / "eval.json").read_text())
    assert [r["block_size"] for r in report["results"]] == [4, 8, 16]
    assert all(r["mean_acceptance_length"] >= 1.0 for r in report["results"])
    assert len(list((runs / "distill").glob("chunk_*.pt"))) == 2


def test_training_resumes_from_checkpoint(smoke_run: tuple[Path, Path]) -> None:
    out, runs = smoke_run
    args = [
        "target",
        "--smoke",
        "--max-files",
        "3",
        "--out-dir",
        str(out),
        "--runs-dir",
        str(runs),
        "--threads",
        "1",
    ]
    assert main([*args, "--steps", "5"]) == 0
    state = torch.load(runs / "target" / "ckpt.pt", weights_only=True)
    assert state["step"] == 5
    steps = [json.loads(line)["step"] for line in (runs / "target" / "log.jsonl").open()]
    assert steps == [0, 2, 4]  # steps 0..2 from the first run, then 3..4 resumed


def test_missing_inputs_fail_cleanly(tmp_path: Path) -> None:
    assert (
        main(
            ["drafter", "--smoke", "--out-dir", str(tmp_path), "--runs-dir", str(tmp_path / "runs")]
        )
        == 1
    )


def test_a_second_drafter_on_other_layers_keeps_the_first(
    smoke_run: tuple[Path, Path], tmp_path: Path
) -> None:
    """`--target-layer-ids` and `--drafter-dir`: how the portable bundled drafter was made
    (layers an engine can capture), beside the first drafter, with its own features."""
    out, _ = smoke_run
    first = (out / "dflash" / "config.json").read_text()
    runs = tmp_path / "runs"
    common = ["--smoke", "--max-files", "3", "--out-dir", str(out), "--runs-dir", str(runs)]
    layers = ["--target-layer-ids", "0"]
    assert main(["distill", *common, *layers]) == 0
    assert main(["drafter", *common, *layers, "--drafter-dir", "dflash-early"]) == 0
    assert main(["eval", *common, "--drafter-dir", "dflash-early"]) == 0
    config = json.loads((out / "dflash-early" / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [0]
    assert (out / "dflash" / "config.json").read_text() == first
    assert json.loads((runs / "eval.json").read_text())["results"]
    # Features made for other layers are refused, not silently reused.
    assert main(["drafter", *common, "--drafter-dir", "dflash-other"]) == 1


def test_a_dflash2_drafter_beside_the_dflash_one(smoke_run: tuple[Path, Path]) -> None:
    """`--arch dflash2`: its own folder, run folder and eval report; the DFlash2 layout,
    loadable by the engine; the DFlash drafter untouched."""
    out, runs = smoke_run
    first = (out / "dflash" / "model.safetensors").read_bytes()
    common = ["--smoke", "--max-files", "3", "--out-dir", str(out), "--runs-dir", str(runs)]
    assert main(["drafter", *common, "--arch", "dflash2"]) == 0
    assert main(["eval", *common, "--arch", "dflash2", "--eval-temperature", "0.7"]) == 0
    config = json.loads((out / "dflash2" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["dflash_config"]["selector_top_k"] == 4
    drafter = load_drafter(out / "dflash2", load_target(out / "target"))
    assert isinstance(drafter, DFlash2Drafter)
    assert (out / "dflash" / "model.safetensors").read_bytes() == first
    rows = [json.loads(line) for line in (runs / "drafter-dflash2" / "log.jsonl").open()]
    assert rows and all(r["selector_loss"] >= 0 and r["block_loss"] > 0 for r in rows)
    report = json.loads((runs / "eval-dflash2.json").read_text())
    assert all(r["mean_acceptance_length"] >= 1.0 for r in report["results"])
    sampled = report["sampled_results"]
    assert [(r["temperature"], r["block_size"]) for r in sampled] == [(0.7, 4), (0.7, 8), (0.7, 16)]
    assert all(r["mean_acceptance_length"] >= 1.0 for r in sampled)
    assert all(r["greedy_oracle_acceptance_length"] >= 1.0 for r in sampled)
    assert all(r["greedy_oracle_verify_steps"] > 0 for r in sampled)


@pytest.mark.parametrize("layers", ["3,1", "1,1", "-1", "a,b", ""])
def test_bad_layer_lists_are_refused(layers: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["drafter", "--target-layer-ids", layers])
    assert exc.value.code == 2
    assert "--target-layer-ids" in capsys.readouterr().err
