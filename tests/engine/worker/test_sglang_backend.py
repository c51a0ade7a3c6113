"""`dflash-worker --backend sglang`: the same settings as SGLang's launch_server argv."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.worker.cli import main
from engine.worker.settings import BUNDLED_DRAFTER, BUNDLED_TARGET, ConfigError, load_settings
from engine.worker.sglang_backend import build_sglang_argv


def portable_drafter(tmp_path: Path) -> Path:
    """The bundled drafter's config with layers SGLang can capture (a config for argv checks;
    its weights were trained on [1, 3, 5] and are not served from here)."""
    folder = tmp_path / "drafter-134"
    shutil.copytree(BUNDLED_DRAFTER, folder)
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [1, 3, 4]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    assert main(["--backend", "sglang", *args, "--dry-run"]) == 0
    argv: list[str] = json.loads(capsys.readouterr().out)
    return argv


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_dflash_flags_and_the_vllm_named_settings(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    drafter = portable_drafter(tmp_path)
    spec = json.dumps({"method": "dflash", "model": str(drafter), "num_speculative_tokens": 7})
    argv = dry_run(
        capsys,
        str(BUNDLED_TARGET),
        "--speculative-config",
        spec,
        "--max-num-seqs",
        "16",
        "--max-model-len",
        "1024",
        "--served-model-name",
        "tiny-coder",
        "--port",
        "30000",
        "--api-key",
        "s3cret",
        "--log-requests",  # an SGLang flag of its own: passed through
    )
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    assert flag(argv, "--model-path") == str(BUNDLED_TARGET)
    assert flag(argv, "--speculative-algorithm") == "DFLASH"
    assert flag(argv, "--speculative-draft-model-path") == str(drafter)
    assert flag(argv, "--speculative-num-draft-tokens") == "8"  # drafts + the last token
    assert flag(argv, "--max-running-requests") == "16"
    assert flag(argv, "--context-length") == "1024"
    assert flag(argv, "--served-model-name") == "tiny-coder"
    assert flag(argv, "--api-key") == "<redacted>" and "s3cret" not in argv
    assert "--enable-metrics" in argv and argv[-1] == "--log-requests"


def test_block_size_comes_from_the_drafter_unless_fewer_drafts_are_asked(
    tmp_path: Path,
) -> None:
    drafter = portable_drafter(tmp_path)
    settings = load_settings(
        backend="sglang",
        model=str(BUNDLED_TARGET),
        speculative_config={"method": "dflash", "model": str(drafter)},
    )
    argv = build_sglang_argv(settings)
    assert "--speculative-num-draft-tokens" not in argv  # SGLang reads block_size itself
    plain = build_sglang_argv(load_settings(backend="sglang", speculative_config=None))
    assert "--speculative-algorithm" not in plain


def test_a_published_pair_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    spec = json.dumps({"method": "dflash", "model": "z-lab/Qwen3-8B-DFlash-b16"})
    argv = dry_run(
        capsys, "Qwen/Qwen3-8B", "--speculative-config", spec, "--tensor-parallel-size", "2"
    )
    assert flag(argv, "--model-path") == "Qwen/Qwen3-8B"
    assert flag(argv, "--speculative-draft-model-path") == "z-lab/Qwen3-8B-DFlash-b16"
    assert flag(argv, "--served-model-name") == "Qwen/Qwen3-8B"
    assert flag(argv, "--tp-size") == "2"


def test_what_sglang_cannot_do_is_refused_naming_the_field(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--backend", "sglang", "--dry-run"]) == 2  # the bundled drafter reads layer 5
    assert "target_layer_ids [1, 3, 5]" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="one --api-key"):
        build_sglang_argv(
            load_settings(backend="sglang", speculative_config=None, api_key=("a", "b"))
        )
    assert main(["--backend", "sglang", "--no-speculation", "--speculation", "adaptive"]) == 2
    assert "adaptive is the embedded engine's" in capsys.readouterr().err
