"""The production backend: the same WorkerSettings become the argv of `vllm serve`."""

from __future__ import annotations

import os
import shutil

from engine.worker.settings import ConfigError, WorkerSettings

REDACTED = "<redacted>"


def build_vllm_argv(settings: WorkerSettings, *, redact: bool = False) -> list[str]:
    """The exact `vllm serve` command line for these settings (argv[0] = "vllm")."""
    s = settings
    argv = ["vllm", "serve", s.model, "--served-model-name", s.model_name]
    argv += ["--host", s.host, "--port", str(s.port)]
    argv += ["--max-num-seqs", str(s.max_num_seqs)]
    if s.max_model_len is not None:
        argv += ["--max-model-len", str(s.max_model_len)]
    argv += ["--seed", str(s.seed), "--dtype", s.dtype]
    argv += ["--tensor-parallel-size", str(s.tensor_parallel_size)]
    argv += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
    if s.api_key:
        argv += ["--api-key", REDACTED if redact else s.api_key]
    if s.speculative_config is not None:
        argv += ["--speculative-config", s.speculative_config.as_json(s.num_speculative_tokens())]
    # Per-request metrics on every response and on the final usage chunk of every stream:
    # the gateway reads them (DESIGN §3), whichever backend answers.
    argv += ["--per-request-spec-decode-metrics", s.per_request_spec_decode_metrics]
    argv += ["--enable-force-include-usage", "--enable-per-request-metrics"]
    return argv + list(s.extra_args)


def exec_vllm(settings: WorkerSettings) -> None:
    """Replace this process with `vllm serve` (signals then go straight to vLLM)."""
    argv = build_vllm_argv(settings)
    exe = shutil.which(argv[0])
    if exe is None:
        raise ConfigError(
            "backend: the `vllm` executable is not on PATH (install the [vllm] extra on a GPU node)"
        )
    os.execv(exe, argv)
