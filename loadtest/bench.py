"""`dflash-bench`: one entry point, one module per benchmark.

Each subcommand lives in its own module with a `main(argv) -> int` and is imported only when
chosen, so `dflash-bench gateway` never loads torch.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("loadtest.engine_bench", "embedded engine: tokens/s, acceptance, DFlash vs plain"),
    "gateway": ("loadtest.gateway_bench", "latency the gateway adds and its max requests/s"),
    "step": ("loadtest.step_bench", "one speculative step's cost by phase, in plain-step units"),
    "sweep": ("loadtest.sweep", "throughput at fixed interactivity: Locust over concurrencies"),
    "backends": ("loadtest.backends_bench", "embedded worker vs real vLLM, plain and DFlash"),
    "speedup": ("loadtest.speedup_bench", "DFlash worker vs plain worker through HTTP, c=1..32"),
    "adapt": (
        "loadtest.adapt_bench",
        "capture a new domain, dflash-train adapt, old vs new drafter",
    ),
    "gpu": ("loadtest.gpu_bench", "make gpu-bench: engine + step benches on CUDA, one table"),
    "drafters": ("loadtest.drafters_bench", "bundled DFlash vs DFlash2 drafter, c=1 through HTTP"),
    "fleet": (
        "loadtest.fleet_bench",
        "mixed stream, DFlash + plain pools: splits vs fastest",
    ),
    "promotion": (
        "loadtest.promotion_bench",
        "better, worse and identical canaries promoted or rolled back on live pools",
    ),
}

# Variants of a benchmark that live in modules of their own, chosen by a flag (they import
# the benchmark's helpers; the benchmark never imports them).
VARIANTS: dict[str, dict[str, str]] = {
    "gateway": {"--peers": "loadtest.gateway_peers", "--scaling": "loadtest.gateway_scaling"},
    "speedup": {"--matrix": "loadtest.speedup_matrix"},
}


def _usage() -> str:
    lines = ["usage: dflash-bench {" + ",".join(SUBCOMMANDS) + "} [options]", ""]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    for name, variants in VARIANTS.items():
        lines.append(f"  {name} {' | '.join(variants)}: see {', '.join(variants.values())}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in {"-h", "--help"}:
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"dflash-bench: unknown benchmark {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    chosen = [module for flag, module in VARIANTS.get(name, {}).items() if flag in rest]
    module = importlib.import_module(chosen[0] if chosen else SUBCOMMANDS[name][0])
    result: int = module.main(rest)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
