"""`dflash-worker`: flags as in `vllm serve`, --dry-run, and the exec of the vLLM backend."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from engine.worker import vllm_backend
from engine.worker.cli import main, settings_from_args
from engine.worker.vllm_backend import build_vllm_argv
from tests.fixtures.tiny_models import TinyCheckpoint

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint: TinyCheckpoint) -> TinyCheckpoint:
    return tiny_checkpoint  # the session's tiny random target + drafter (tests/conftest.py)


def dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    assert main([*args, "--dry-run"]) == 0
    argv = json.loads(capsys.readouterr().out)
    assert isinstance(argv, list)
    return argv


def test_dry_run_prints_the_exact_vllm_serve_argv(
    ckpt: TinyCheckpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = json.dumps({"method": "dflash", "model": str(ckpt.drafter_dir)})
    argv = dry_run(
        capsys,
        str(ckpt.target_dir),
        "--speculative-config",
        spec,
        "--max-num-seqs",
        "4",
        "--max-model-len",
        "1024",
        "--served-model-name",
        "c",
        "--port",
        "9000",
        "--per-request-spec-decode-metrics",
        "detailed",
    )
    assert argv == [
        "vllm",
        "serve",
        str(ckpt.target_dir),
        "--served-model-name",
        "c",
        "--host",
        "127.0.0.1",
        "--port",
        "9000",
        "--max-num-seqs",
        "4",
        "--max-model-len",
        "1024",
        "--seed",
        "0",
        "--dtype",
        "auto",
        "--tensor-parallel-size",
        "1",
        "--gpu-memory-utilization",
        "0.9",
        "--speculative-config",
        json.dumps(
            {"method": "dflash", "model": str(ckpt.drafter_dir), "num_speculative_tokens": 3},
            separators=(",", ":"),
        ),
        "--per-request-spec-decode-metrics",
        "detailed",
        "--enable-per-request-metrics",
        "--shutdown-timeout",
        "30",
    ]


def test_both_backends_print_the_same_argv_and_vllm_keeps_extra_args(
    ckpt: TinyCheckpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = json.dumps({"model": str(ckpt.drafter_dir), "num_speculative_tokens": 2})
    base = [str(ckpt.target_dir), "--speculative-config", spec]
    embedded = dry_run(capsys, *base)
    vllm = dry_run(capsys, "--backend", "vllm", *base, "--enable-prefix-caching")
    assert vllm == [*embedded, "--enable-prefix-caching"]
    assert (
        json.loads(embedded[embedded.index("--speculative-config") + 1])["num_speculative_tokens"]
        == 2
    )


def test_no_speculation_drops_the_speculative_config(
    ckpt: TinyCheckpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = json.dumps({"model": str(ckpt.drafter_dir)})
    argv = dry_run(capsys, str(ckpt.target_dir), "--speculative-config", spec, "--no-speculation")
    assert "--speculative-config" not in argv
    assert "--per-request-spec-decode-metrics" not in argv  # vLLM refuses it without a drafter


def test_api_key_is_redacted_in_dry_run(
    ckpt: TinyCheckpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = dry_run(capsys, str(ckpt.target_dir), "--api-key", "s3cret")
    assert "s3cret" not in argv
    assert argv[argv.index("--api-key") + 1] == "<redacted>"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--speculative-config", "{not json"], "speculative_config: not JSON"),
        (["--speculative-config", '{"num_speculative_tokens": 9}'], "speculative_config.model"),
        (["--max-num-seqs", "0"], "max_num_seqs"),
        (["--seed", "-1"], "seed"),
    ],
)
def test_bad_settings_exit_2_with_one_line(
    ckpt: TinyCheckpoint, capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    assert main([str(ckpt.target_dir), *args, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dflash-worker: error: invalid worker setting")
    assert needle in err and "\n" not in err


def test_unknown_flags_are_refused_by_the_embedded_backend(
    ckpt: TinyCheckpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([str(ckpt.target_dir), "--enable-prefix-caching", "--dry-run"])
    assert info.value.code == 2
    assert "unrecognized arguments: --enable-prefix-caching" in capsys.readouterr().err


def test_vllm_backend_without_vllm_installed(
    ckpt: TinyCheckpoint,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("DFLASH_VLLM_BIN", raising=False)
    monkeypatch.setattr(vllm_backend, "CPU_BUILD", tmp_path / "no-such-venv" / "vllm")
    assert main(["--backend", "vllm", str(ckpt.target_dir)]) == 2
    err = capsys.readouterr().err
    assert "no `vllm` executable" in err and "make vllm-env" in err


def test_vllm_bin_must_be_an_executable(
    ckpt: TinyCheckpoint, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["--backend", "vllm", str(ckpt.target_dir), "--vllm-bin", str(tmp_path / "nope")]
    assert main(args) == 2
    assert "vllm_bin" in capsys.readouterr().err


def test_vllm_backend_execs_vllm_serve(ckpt: TinyCheckpoint, tmp_path: Path) -> None:
    """The console script execs `vllm` with the same argv as --dry-run (key not redacted)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "argv.json"
    fake = bindir / "vllm"
    fake.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(record)!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    script = Path(sys.executable).parent / "dflash-worker"
    args = ["--backend", "vllm", str(ckpt.target_dir), "--api-key", "k", "--max-num-seqs", "2"]
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    dry = subprocess.run(
        [str(script), *args, "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
        check=True,
    )
    run = subprocess.run(
        [str(script), *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )
    assert run.returncode == 0, run.stderr
    executed = json.loads(record.read_text())
    expected = json.loads(dry.stdout)[1:]
    expected[expected.index("--api-key") + 1] = "k"
    assert executed == expected


def test_several_api_keys_for_rotation(ckpt: TinyCheckpoint) -> None:
    settings, _ = settings_from_args([str(ckpt.target_dir), "--api-key", "old", "new"])
    assert settings.api_key == ("old", "new") and "old" not in repr(settings)
    argv = build_vllm_argv(settings.model_copy(update={"backend": "vllm"}))
    assert argv[argv.index("--api-key") + 1 : argv.index("--api-key") + 3] == ["old", "new"]
