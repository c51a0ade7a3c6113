"""The TensorRT-LLM backend: the same WorkerSettings become `trtllm-serve MODEL --backend
pytorch ... --extra_llm_api_options FILE` and that file, the LLM API's YAML with DFlash in
`speculative_config` (`DFlashDecodingConfig` in `tensorrt_llm/llmapi/llm_args.py`; PyTorch
backend only; in the 1.3.0 and 1.4.0 pre-releases, not in 1.2.1).

Nothing of TensorRT-LLM installs without NVIDIA's own index, so the YAML is checked in the tests
against a JSON Schema written from that class (tests/fixtures/trtllm_dflash_llm_api.schema.json).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Any

import yaml

from engine.worker.settings import ConfigError, WorkerSettings
from engine.worker.vllm_backend import engine_tracing_env


def llm_api_options(settings: WorkerSettings) -> dict[str, Any]:
    """The `--extra_llm_api_options` YAML as a mapping."""
    s = settings
    options: dict[str, Any] = {
        # /prometheus/metrics (trtllm_* series) and per-request perf metrics.
        "return_perf_metrics": True,
        "enable_iter_perf_stats": True,
        "kv_cache_config": {"free_gpu_memory_fraction": s.gpu_memory_utilization},
    }
    if s.tracing.enabled:  # BaseLlmArgs.otlp_traces_endpoint (prototype in TensorRT-LLM)
        options["otlp_traces_endpoint"] = s.tracing.url()
    spec = s.speculative_config
    if spec is not None:
        drafts = s.num_speculative_tokens()
        if drafts is None:
            raise ConfigError(
                "speculative_config.num_speculative_tokens: TensorRT-LLM needs max_draft_len; "
                "give it, or a local drafter whose config.json has block_size"
            )
        options["speculative_config"] = {
            "decoding_type": "DFlash",
            "max_draft_len": drafts,
            "speculative_model": spec.model,
        }
    return options


def build_trtllm_argv(settings: WorkerSettings, options_path: str) -> list[str]:
    """`trtllm-serve ...` for these settings, reading its LLM API options from `options_path`."""
    s = settings
    if s.api_key:
        raise ConfigError(
            "api_key: trtllm-serve takes no API key; keep its port reachable from the gateway "
            "only (the chart's NetworkPolicy)"
        )
    argv = ["trtllm-serve", s.model, "--backend", "pytorch"]
    argv += ["--served_model_name", s.model_name, "--host", s.host, "--port", str(s.port)]
    argv += ["--max_batch_size", str(s.max_num_seqs)]
    if s.max_model_len is not None:
        argv += ["--max_seq_len", str(s.max_model_len)]
    argv += ["--tp_size", str(s.tensor_parallel_size)]
    # Each step of each sequence verifies max_draft_len + 1 tokens.
    drafts = s.num_speculative_tokens() or 0
    argv += ["--max_num_tokens", str(max(8192, s.max_num_seqs * (drafts + 1)))]
    argv += ["--extra_llm_api_options", options_path]
    return argv + list(s.extra_args)


def dry_run(settings: WorkerSettings, options_path: str) -> str:
    """What --dry-run prints: the argv as a JSON line, then the YAML document."""
    import json

    argv = json.dumps(build_trtllm_argv(settings, options_path))
    return argv + "\n---\n" + yaml.safe_dump(llm_api_options(settings), sort_keys=True)


def exec_trtllm(settings: WorkerSettings) -> None:
    """Write the LLM API options, then replace this process with trtllm-serve."""
    exe = shutil.which("trtllm-serve")
    if exe is None:
        raise ConfigError("backend: no `trtllm-serve` on PATH (TensorRT-LLM's image has it)")
    handle, path = tempfile.mkstemp(prefix="dflash-trtllm-", suffix=".yaml")
    with os.fdopen(handle, "w") as out:
        yaml.safe_dump(llm_api_options(settings), out, sort_keys=True)
    argv = build_trtllm_argv(settings, path)
    print(
        f"dflash-worker: starting TensorRT-LLM ({exe}) on {settings.host}:{settings.port} with "
        f"{path}; its own log follows",
        file=sys.stderr,
        flush=True,
    )
    os.execve(exe, argv, {**os.environ, **engine_tracing_env(settings.tracing)})
