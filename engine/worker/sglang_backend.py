"""The SGLang backend: the same WorkerSettings become the argv of `python -m
sglang.launch_server` with DFlash (`--speculative-algorithm DFLASH`).

Flags as SGLang 0.5.23's `sglang/srt/server_args.py` names them (read from its source, checked
by its own parser where `make sglang-env` installed it): `--max-running-requests` is vLLM's
`--max-num-seqs`, `--context-length` its `--max-model-len`, `--mem-fraction-static` its
`--gpu-memory-utilization`. DFlash's block size is read from the drafter's config unless
`num_speculative_tokens` asks for fewer drafts (block = drafts + 1). Tracing: `--enable-trace`,
`--otlp-traces-endpoint`, `--otlp-service-name` (arg_groups/fields/observability.py there).
"""

from __future__ import annotations

import os
import shutil
import sys

from engine.worker.settings import ConfigError, WorkerSettings
from engine.worker.vllm_backend import engine_tracing_env
from wire.tracing import WORKER_SERVICE

REDACTED = "<redacted>"


def build_sglang_argv(settings: WorkerSettings, *, redact: bool = False) -> list[str]:
    """`python3 -m sglang.launch_server ...` for these settings."""
    s = settings
    argv = ["python3", "-m", "sglang.launch_server", "--model-path", s.model]
    argv += ["--served-model-name", s.model_name, "--host", s.host, "--port", str(s.port)]
    argv += ["--max-running-requests", str(s.max_num_seqs)]
    if s.max_model_len is not None:
        argv += ["--context-length", str(s.max_model_len)]
    argv += ["--random-seed", str(s.seed), "--dtype", s.dtype]
    argv += ["--tp-size", str(s.tensor_parallel_size)]
    argv += ["--mem-fraction-static", str(s.gpu_memory_utilization)]
    if "device" in s.model_fields_set:  # SGLang's default: its platform's (cuda on a GPU)
        argv += ["--device", s.device]
    if s.api_key:
        if len(s.api_key) > 1:
            raise ConfigError("api_key: SGLang takes one --api-key (rotate through the gateway)")
        argv += ["--api-key", REDACTED if redact else s.api_key[0]]
    spec = s.speculative_config
    if spec is not None:
        argv += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", spec.model]
        if spec.num_speculative_tokens is not None:
            argv += ["--speculative-num-draft-tokens", str(spec.num_speculative_tokens + 1)]
    # /metrics (sglang:* series): the gateway's load signal and the dashboard's.
    argv += ["--enable-metrics"]
    if s.tracing.enabled:  # SGLang's own request spans (its trace.py reads the protocol env)
        argv += ["--enable-trace", "--otlp-traces-endpoint", s.tracing.url()]
        argv += ["--otlp-service-name", s.tracing.service(WORKER_SERVICE)]
    return argv + list(s.extra_args)


def exec_sglang(settings: WorkerSettings) -> None:
    """Replace this process with SGLang's server (signals then go straight to it)."""
    python = shutil.which("python3") or sys.executable
    argv = build_sglang_argv(settings)
    print(
        f"dflash-worker: starting SGLang ({python} -m sglang.launch_server) on "
        f"{settings.host}:{settings.port}; SGLang's own log follows",
        file=sys.stderr,
        flush=True,
    )
    env = {**os.environ, **engine_tracing_env(settings.tracing)}
    os.execve(python, [python, *argv[1:]], env)
