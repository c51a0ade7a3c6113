"""`dflash-worker --backend sglang`: the same settings as SGLang's launch_server argv."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.worker.cli import main
from engine.worker.settings import (
    BUNDLED_DRAFTER,
    BUNDLED_PORTABLE_DRAFTER,
    BUNDLED_TARGET,
    ConfigError,
    load_settings,
)
from engine.worker.sglang_backend import build_sglang_argv
from tests.fixtures.sglang_parser import parse_with_sglang, require_sglang_env


def dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    assert main(["--backend", "sglang", *args, "--dry-run"]) == 0
    argv: list[str] = json.loads(capsys.readouterr().out)
    return argv


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_dflash_flags_and_the_vllm_named_settings(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    drafter = BUNDLED_PORTABLE_DRAFTER
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
    drafter = BUNDLED_PORTABLE_DRAFTER
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
    spec = json.dumps({"method": "dflash", "model": str(BUNDLED_DRAFTER)})
    assert main(["--backend", "sglang", "--speculative-config", spec, "--dry-run"]) == 2
    assert "target_layer_ids [1, 3, 5]" in capsys.readouterr().err  # it reads layer 5 of 6
    with pytest.raises(ConfigError, match="one --api-key"):
        build_sglang_argv(
            load_settings(backend="sglang", speculative_config=None, api_key=("a", "b"))
        )
    assert main(["--backend", "sglang", "--no-speculation", "--speculation", "adaptive"]) == 2
    assert "adaptive is the embedded engine's" in capsys.readouterr().err


def test_sglangs_own_parser_accepts_the_argv(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang 0.5.23's ServerArgs (installed without CUDA by `make sglang-env`) parses and
    validates what `dflash-worker --backend sglang` produces. `--device cuda` is added: SGLang
    refuses DFlash on a CPU, and this machine has no GPU (the validation needs none)."""
    require_sglang_env()
    drafter = BUNDLED_PORTABLE_DRAFTER
    spec = {"method": "dflash", "model": str(drafter)}
    base = [str(BUNDLED_TARGET), "--max-model-len", "1024", "--api-key", "s3cret"]
    cases = {
        "dflash": dry_run(capsys, *base, "--speculative-config", json.dumps(spec)),
        "k7": dry_run(
            capsys,
            *base,
            "--speculative-config",
            json.dumps({**spec, "num_speculative_tokens": 7}),
        ),
        "plain": dry_run(capsys, *base, "--no-speculation"),
        # The check can fail: a block size that disagrees with the draft tokens.
        "mismatch": dry_run(
            capsys,
            *base,
            "--speculative-config",
            json.dumps({**spec, "num_speculative_tokens": 7}),
            "--speculative-dflash-block-size",
            "16",
        ),
    }
    # A DFlash2 drafter: the same flags (SGLang 0.5.23 picks DFlash2DraftModel from its config).
    from tests.fixtures.tiny_dflash2 import build_tiny_dflash2_checkpoint

    d2 = build_tiny_dflash2_checkpoint(tmp_path / "d2")
    d2_spec = json.dumps({"method": "dflash2", "model": str(d2.drafter_dir)})
    cases["dflash2"] = dry_run(
        capsys, str(d2.target_dir), "--max-model-len", "1024", "--speculative-config", d2_spec
    )
    # Tracing (docs/tracing.md): OTEL_* become SGLang's own flags.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "pool-a")
    cases["traced"] = dry_run(capsys, *base, "--speculative-config", json.dumps(spec))
    results = parse_with_sglang({name: argv[3:] for name, argv in cases.items()}, tmp_path)
    for name in ("dflash", "k7", "plain"):
        assert "error" not in results[name], (name, results[name])
        assert results[name]["max_running_requests"] == 8  # --max-num-seqs' default
        assert results[name]["context_length"] == 1024
        assert results[name]["served_model_name"] == "tiny-coder"
        assert results[name]["enable_metrics"] is True
    assert results["dflash"]["speculative_algorithm"] == "DFLASH"
    assert results["dflash"]["speculative_num_draft_tokens"] == 16  # the drafter's block_size
    assert results["k7"]["speculative_num_draft_tokens"] == 8
    assert results["plain"]["speculative_algorithm"] in (None, "NONE")
    assert "error" not in results["dflash2"], results["dflash2"]
    assert results["dflash2"]["speculative_algorithm"] == "DFLASH"
    assert results["dflash2"]["speculative_num_draft_tokens"] == 8  # its block_size
    assert "must match" in results["mismatch"]["error"], results["mismatch"]
    traced = results["traced"]
    assert "error" not in traced, traced
    assert traced["enable_trace"] is True and not results["dflash"]["enable_trace"]
    assert traced["otlp_traces_endpoint"] == "http://collector:4317"
    assert traced["otlp_service_name"] == "pool-a"


def test_the_bundled_pair_for_sglang_is_the_portable_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = dry_run(capsys)
    assert flag(argv, "--model-path") == str(BUNDLED_TARGET)
    assert flag(argv, "--speculative-draft-model-path") == str(BUNDLED_PORTABLE_DRAFTER)


def test_device_goes_to_sglang_only_when_given(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--device" not in dry_run(capsys)  # SGLang's own default (its platform's)
    assert flag(dry_run(capsys, "--device", "cpu"), "--device") == "cpu"
    for backend in ("vllm", "trtllm"):
        assert main(["--backend", backend, "--device", "cpu", "--dry-run"]) == 2
        assert f"device: the embedded engine's and SGLang's (--device); {backend}" in (
            capsys.readouterr().err
        )
