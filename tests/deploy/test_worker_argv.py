"""The worker command the chart renders is a valid `dflash-worker` command, and the `vllm
serve` argv it becomes (`--dry-run`) is accepted by vLLM 0.33's own parser with our values."""

from __future__ import annotations

import json
import os
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from engine.worker.cli import build_parser, settings_from_args
from engine.worker.settings import BUNDLED_TARGET
from tests.deploy.chart import ROOT, find, render
from tests.fixtures.worker import worker_dry_run

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_PRESETS = {"default": (), "b200": ("values-b200.yaml",), "b300": ("values-b300.yaml",)}
TP4 = ("worker.tensorParallelSize=4", "worker.extraArgs[0]=--enable-prefix-caching")
LWS = ("ci/multinode-lws-values.yaml",)
# What the kubelet substitutes for $(VAR) in args: the worker key from the Secret, and the
# variables the LeaderWorkerSet controller sets in every pod of a group.
POD_ENV = {
    "DFLASH_WORKER_API_KEY": "wk-test-key-0123456789",
    "LWS_LEADER_ADDRESS": "rel-dflash-serving-worker-0.rel-dflash-serving-worker.llm",
    "LWS_WORKER_INDEX": "1",
}


def expand(arg: str) -> str:
    for name, value in POD_ENV.items():
        arg = arg.replace(f"$({name})", value)
    assert "$(" not in arg, arg  # a variable the pod does not define would stay literal
    return arg


def pod_container(values: tuple[str, ...], sets: tuple[str, ...], role: str) -> dict[str, Any]:
    docs = render(values, sets)
    if role == "single":
        pod = find(docs, "Deployment", "-worker")["spec"]["template"]
    else:
        lwt = find(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
        pod = lwt["leaderTemplate" if role == "leader" else "workerTemplate"]
    c: dict[str, Any] = pod["spec"]["containers"][0]
    return c


@cache
def worker_command(
    values: tuple[str, ...], sets: tuple[str, ...] = (), role: str = "single"
) -> list[str]:
    c = pod_container(values, sets, role)
    assert c["command"] == ["dflash-worker"]
    return [expand(str(a)) for a in c["args"]]


@cache
def dry_run(values: tuple[str, ...], sets: tuple[str, ...] = (), role: str = "single") -> list[str]:
    """The real CLI, as the container runs it: `dflash-worker <args> --dry-run`."""
    stdout = worker_dry_run(*worker_command(values, sets, role))
    argv: list[str] = json.loads(stdout)
    return argv


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("preset", list(VLLM_PRESETS))
def test_dry_run_gives_the_vllm_command(preset: str) -> None:
    argv = dry_run(VLLM_PRESETS[preset])
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen3-8B"]
    assert json.loads(flag(argv, "--speculative-config")) == {
        "method": "dflash",
        "model": "z-lab/Qwen3-8B-DFlash-b16",
        "num_speculative_tokens": 15,
    }
    assert flag(argv, "--served-model-name") == "qwen3-8b-dflash"
    assert flag(argv, "--host") == "0.0.0.0" and flag(argv, "--port") == "8000"
    assert flag(argv, "--per-request-spec-decode-metrics") == "summary"
    assert "--enable-per-request-metrics" in argv and "--enable-force-include-usage" not in argv
    assert flag(argv, "--shutdown-timeout") is not None
    rendered = worker_command(VLLM_PRESETS[preset])
    for name in (
        "--max-num-seqs",
        "--max-model-len",
        "--gpu-memory-utilization",
        "--dtype",
        "--tensor-parallel-size",
        "--seed",
    ):
        assert flag(argv, name) == flag(rendered, name), name
    # The chart's drain (both backends) is what vLLM gets as its shutdown timeout.
    assert flag(argv, "--shutdown-timeout") == flag(rendered, "--drain-timeout")


def test_workers_require_the_key_without_showing_it() -> None:
    argv = dry_run(VLLM_PRESETS["default"])
    assert flag(argv, "--api-key") == "<redacted>"  # given, and kept out of logs
    assert POD_ENV["DFLASH_WORKER_API_KEY"] not in " ".join(argv)
    ns, _ = build_parser().parse_known_args(worker_command(("values-embedded.yaml",)))
    assert ns.api_key == [POD_ENV["DFLASH_WORKER_API_KEY"]]  # the embedded worker checks it too


@pytest.mark.parametrize("role", ["leader", "node"])
def test_multi_node_commands_carry_vllms_multi_node_flags(role: str) -> None:
    argv = dry_run(LWS, (), role)
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen3-235B-A22B"]
    assert flag(argv, "--tensor-parallel-size") == "8"
    assert flag(argv, "--pipeline-parallel-size") == "2"
    assert flag(argv, "--nnodes") == "2"
    assert flag(argv, "--master-addr") == POD_ENV["LWS_LEADER_ADDRESS"]
    assert flag(argv, "--node-rank") == ("0" if role == "leader" else "1")
    assert ("--headless" in argv) == (role == "node")


def test_tensor_parallel_and_extra_args_pass_through() -> None:
    argv = dry_run(VLLM_PRESETS["b300"], TP4)
    assert flag(argv, "--tensor-parallel-size") == "4"
    assert argv[-1] == "--enable-prefix-caching"


def test_speculation_off_renders_plain_decoding() -> None:
    argv = dry_run((), ("model.speculative.enabled=false",))
    assert "--speculative-config" not in argv


def test_embedded_command_parses_with_no_unknown_flag() -> None:
    ns, unknown = build_parser().parse_known_args(worker_command(("values-embedded.yaml",)))
    assert unknown == []  # the embedded backend takes no vLLM pass-through arguments
    assert (ns.backend, ns.served_model_name, ns.host, ns.port) == (
        "embedded",
        "tiny-coder",
        "0.0.0.0",
        8000,
    )
    assert ns.drain_timeout == 20.0 and ns.max_num_seqs == 8 and not hasattr(ns, "model")


@pytest.mark.skipif(
    not (BUNDLED_TARGET / "config.json").exists(),
    reason="bundled tiny-coder not trained yet (make train)",
)
def test_embedded_command_is_valid_worker_settings() -> None:
    settings, _ = settings_from_args(worker_command(("values-embedded.yaml",)))
    assert settings.backend == "embedded"
    assert settings.model_name == "tiny-coder"
    assert settings.speculative  # the bundled DFlash drafter
    off, _ = settings_from_args(
        worker_command(("values-embedded.yaml",), ("model.speculative.enabled=false",))
    )
    assert not off.speculative


PROBE = r"""
import json, sys
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = {}
for name, argv in json.load(open(sys.argv[1])).items():
    try:
        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[2:])
    except SystemExit as exc:
        out[name] = {"error": f"SystemExit {exc.code}"}
        continue
    keys = ["model_tag", "speculative_config", "tensor_parallel_size", "shutdown_timeout",
            "max_num_seqs", "max_model_len", "gpu_memory_utilization",
            "per_request_spec_decode_metrics", "enable_prefix_caching", "api_key",
            "pipeline_parallel_size", "nnodes", "node_rank", "master_addr", "headless"]
    out[name] = {k: getattr(ns, k, None) for k in keys}
print("RESULTS " + json.dumps(out, default=str))
"""


@pytest.mark.vllm
def test_vllm_parser_accepts_the_rendered_commands(tmp_path: Path) -> None:
    if not VLLM_PYTHON.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(".venv-vllm is missing: run `make vllm-env`")
        pytest.skip(".venv-vllm is missing: run `make vllm-env`")
    cases = {name: dry_run(values) for name, values in VLLM_PRESETS.items()}
    cases["tp4"] = dry_run(VLLM_PRESETS["b300"], TP4)
    cases["lws-leader"] = dry_run(LWS, (), "leader")
    cases["lws-node"] = dry_run(LWS, (), "node")
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    (tmp_path / "probe.py").write_text(PROBE)
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(tmp_path / "probe.py"), str(tmp_path / "cases.json")],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")]
    assert line, proc.stdout[-2000:] + proc.stderr[-4000:]
    results: dict[str, Any] = json.loads(line[0].removeprefix("RESULTS "))
    for name, got in results.items():
        assert "error" not in got, (name, got)
        assert got["api_key"] == ["<redacted>"] or got["api_key"] == "<redacted>"
        if name.startswith("lws"):
            continue
        assert got["model_tag"] == "Qwen/Qwen3-8B"
        assert got["shutdown_timeout"] == 60
        assert got["per_request_spec_decode_metrics"] == "summary"
        spec = got["speculative_config"]
        spec = json.loads(spec) if isinstance(spec, str) else spec
        assert spec["method"] == "dflash" and spec["num_speculative_tokens"] == 15
    assert results["b200"]["max_num_seqs"] == 128 and results["b300"]["max_model_len"] == 32768
    assert results["tp4"]["tensor_parallel_size"] == 4 and results["tp4"]["enable_prefix_caching"]
    leader, node = results["lws-leader"], results["lws-node"]
    assert (leader["nnodes"], leader["node_rank"], leader["headless"]) == (2, 0, False)
    assert (node["nnodes"], node["node_rank"], node["headless"]) == (2, 1, True)
    assert leader["pipeline_parallel_size"] == 2 and leader["tensor_parallel_size"] == 8


DIRECT = ("worker.launcher=vllm",)
DIRECT_CASES = [
    *[(values, (), "single") for values in VLLM_PRESETS.values()],
    (VLLM_PRESETS["b300"], TP4, "single"),
    ((), ("model.speculative.enabled=false",), "single"),
    (LWS, (), "leader"),
    (LWS, (), "node"),
]


def comparable(argv: list[str]) -> list[str]:
    """An argv with the worker key hidden and the speculative config's JSON normalised."""
    out = ["<redacted>" if a == POD_ENV["DFLASH_WORKER_API_KEY"] else a for a in argv]
    if "--speculative-config" in out:
        i = out.index("--speculative-config") + 1
        out[i] = json.dumps(json.loads(out[i]), sort_keys=True)
    return out


@pytest.mark.parametrize(("values", "sets", "role"), DIRECT_CASES)
def test_vllms_own_image_runs_the_command_dflash_worker_would(
    values: tuple[str, ...], sets: tuple[str, ...], role: str
) -> None:
    """worker.launcher: vllm renders exactly the `vllm serve` argv that `dflash-worker
    --backend vllm` execs for the same values (its --dry-run), on vLLM's official image."""
    c = pod_container(values, (*sets, *DIRECT), role)
    assert c["command"] == ["vllm", "serve"]
    assert c["image"] == "docker.io/vllm/vllm-openai:v0.33.0"
    direct = ["vllm", "serve", *[expand(str(a)) for a in c["args"]]]
    assert comparable(direct) == comparable(dry_run(values, sets, role))


def test_the_embedded_mode_ignores_the_launcher() -> None:
    c = pod_container(("values-embedded.yaml",), DIRECT, "single")
    assert c["command"] == ["dflash-worker"] and "embedded" in c["image"]
