"""`dflash-worker --backend trtllm`: trtllm-serve's argv and its LLM API YAML, the YAML checked
against a schema written from TensorRT-LLM's DFlashDecodingConfig (the fixture names the source
and version; TensorRT-LLM itself cannot be installed here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from engine.worker.cli import TRTLLM_OPTIONS, main
from engine.worker.settings import BUNDLED_DRAFTER, BUNDLED_TARGET, ConfigError, load_settings
from engine.worker.trtllm_backend import build_trtllm_argv, llm_api_options

SCHEMA = json.loads(
    (Path(__file__).parents[2] / "fixtures" / "trtllm_dflash_llm_api.schema.json").read_text()
)


def dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[list[str], dict[str, Any]]:
    assert main(["--backend", "trtllm", *args, "--dry-run"]) == 0
    argv_line, document = capsys.readouterr().out.split("\n---\n", 1)
    return json.loads(argv_line), yaml.safe_load(document)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_bundled_pair_as_trtllm_serve_and_its_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    argv, options = dry_run(capsys, "--max-num-seqs", "16", "--max-model-len", "1024")
    jsonschema.validate(options, SCHEMA)
    assert argv[:4] == ["trtllm-serve", str(BUNDLED_TARGET), "--backend", "pytorch"]
    assert flag(argv, "--served_model_name") == "tiny-coder"
    assert flag(argv, "--max_batch_size") == "16" and flag(argv, "--max_seq_len") == "1024"
    assert flag(argv, "--extra_llm_api_options") == TRTLLM_OPTIONS
    assert options["speculative_config"] == {
        "decoding_type": "DFlash",
        "max_draft_len": 15,  # the drafter's block_size - 1
        "speculative_model": str(BUNDLED_DRAFTER),
    }
    assert options["return_perf_metrics"] is True  # mounts /prometheus/metrics


def test_a_published_pair_by_name_needs_its_draft_length(
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = {"method": "dflash", "model": "z-lab/Qwen3-8B-DFlash-b16", "num_speculative_tokens": 7}
    args = ("Qwen/Qwen3-8B", "--speculative-config", json.dumps(spec))
    argv, options = dry_run(capsys, *args, "--tensor-parallel-size", "4")
    jsonschema.validate(options, SCHEMA)
    assert options["speculative_config"]["max_draft_len"] == 7
    assert flag(argv, "--tp_size") == "4"
    assert int(flag(argv, "--max_num_tokens")) >= 8 * 8  # every row verifies 8 tokens a step
    unnamed = load_settings(
        backend="trtllm",
        model="Qwen/Qwen3-8B",
        speculative_config={"method": "dflash", "model": "z-lab/Qwen3-8B-DFlash-b16"},
    )
    with pytest.raises(ConfigError, match="max_draft_len"):
        llm_api_options(unnamed)  # a hub drafter's block size cannot be read here


def test_the_schema_refuses_what_tensorrt_llm_would(capsys: pytest.CaptureFixture[str]) -> None:
    _, options = dry_run(capsys)
    spec = options["speculative_config"]
    for broken in (
        {**options, "speculative_config": {**spec, "block_size": 16}},
        {**options, "speculative_config": {**spec, "decoding_type": "Eagle"}},
        {**options, "speculative_cofig": {}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, SCHEMA)


def test_plain_decoding_and_what_trtllm_serve_cannot_take() -> None:
    plain = load_settings(backend="trtllm", speculative_config=None)
    assert "speculative_config" not in llm_api_options(plain)
    keyed = load_settings(backend="trtllm", speculative_config=None, api_key=("k",))
    with pytest.raises(ConfigError, match="trtllm-serve takes no API key"):
        build_trtllm_argv(keyed, "/tmp/x.yaml")


def test_tracing_goes_into_the_llm_api_options(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """BaseLlmArgs.otlp_traces_endpoint (docs/tracing.md); over HTTP the traces URL."""
    _, plain = dry_run(capsys)
    assert "otlp_traces_endpoint" not in plain
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    _, options = dry_run(capsys)
    jsonschema.validate(options, SCHEMA)
    assert options["otlp_traces_endpoint"] == "http://collector:4318/v1/traces"
