"""`dflash-worker --backend sglang`: the same settings as SGLang's launch_server argv."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
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


SGLANG_PYTHON = Path(__file__).resolve().parents[3] / ".venv-sglang" / "bin" / "python"
# Runs inside .venv-sglang: SGLang's own parse and validation (what launch_server does before
# any GPU work) on each case; prints one JSON line. SGLang's config modules import torchvision,
# which has no CPU build on PyPI: a stand-in module is served (the parse never calls it).
PROBE = r"""
import contextlib, enum, importlib.machinery, importlib.util, io, json, os, sys
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

class StandIn:
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        module.__path__ = []
        module.__version__ = "0.0.0+stand-in"
        module.InterpolationMode = enum.Enum("InterpolationMode", "NEAREST BILINEAR BICUBIC")
        def missing(name):
            if name.startswith("__"):
                raise AttributeError(name)
            return lambda *a, **k: None
        module.__getattr__ = missing

if importlib.util.find_spec("torchvision") is None:
    from transformers.utils import import_utils
    import_utils.is_torchvision_available()
    sys.meta_path.append(StandIn())
from sglang.srt.server_args import prepare_server_args

out = {}
for name, argv in json.load(open(sys.argv[1])).items():
    noise = io.StringIO()
    try:
        with contextlib.redirect_stderr(noise):
            try:
                args = prepare_server_args(argv)
            except SystemExit:
                raise ValueError(noise.getvalue().strip().splitlines()[-1])
            args.resolve_once()
            args.check_server_args()
        keys = ["speculative_algorithm", "speculative_draft_model_path",
                "speculative_num_draft_tokens", "max_running_requests", "context_length",
                "served_model_name", "api_key", "enable_metrics", "port"]
        from sglang.srt.arg_groups.overrides import resolving_view  # values after resolve
        resolved = resolving_view(args)
        out[name] = {k: getattr(resolved, k, None) for k in keys}
    except Exception as exc:
        out[name] = {"error": f"{type(exc).__name__}: {exc}"}
print("RESULTS " + json.dumps(out, default=str))
"""


def test_sglangs_own_parser_accepts_the_argv(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """SGLang 0.5.23's ServerArgs (installed without CUDA by `make sglang-env`) parses and
    validates what `dflash-worker --backend sglang` produces. `--device cuda` is added: SGLang
    refuses DFlash on a CPU, and this machine has no GPU (the validation needs none)."""
    if not SGLANG_PYTHON.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(".venv-sglang is missing: run `make sglang-env`")
        pytest.skip(".venv-sglang is missing: run `make sglang-env`")
    drafter = portable_drafter(tmp_path)
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
    inputs = {name: [*argv[3:], "--device", "cuda"] for name, argv in cases.items()}
    (tmp_path / "cases.json").write_text(json.dumps(inputs))
    (tmp_path / "probe.py").write_text(PROBE)
    proc = subprocess.run(
        [str(SGLANG_PYTHON), str(tmp_path / "probe.py"), str(tmp_path / "cases.json")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")]
    assert line, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = json.loads(line[0].removeprefix("RESULTS "))
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
    assert "must match" in results["mismatch"]["error"], results["mismatch"]
