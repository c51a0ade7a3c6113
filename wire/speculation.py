"""A request's speculative acceptance, computed once for both sides: the worker's `metrics`
object and spans, and the gateway's spans, from the same counts give the same numbers.

Imports nothing: the gateway and the worker both use it (and neither loads the tracing SDK
for it)."""

from __future__ import annotations

from typing import Any


def mean_acceptance_length(accepted: int, steps: int) -> float:
    """Tokens committed per verify step, the bonus token included: 1 + accepted / steps.

    At zero steps it is 1.0, not undefined: a request that never verified a draft decoded
    one token per forward pass, which is what a mean acceptance length of 1 says (plain
    decoding's value). vLLM's per-request object says the same (vLLM 0.33 and 0.32,
    `RequestSpecDecodeMetrics.to_dict` in vllm/v1/metrics/stats.py)."""
    return 1.0 + accepted / steps if steps else 1.0


def draft_acceptance_rate(accepted: int, drafted: int) -> float:
    """The share of drafted tokens the target accepted; 0.0 when nothing was drafted (no
    draft was accepted), as vLLM's per-request object reports it (the same to_dict)."""
    return accepted / drafted if drafted else 0.0


def spec_span_attributes(
    steps: int, accepted: int, drafted: int | None, reported_length: float | None = None
) -> dict[str, Any]:
    """The `dflash.spec.*` attributes of a span (docs/tracing.md): the gateway's server span
    and the worker's decode span carry the same names and values. `drafted` is None where an
    engine does not report it (the rate is then left out, never guessed); `reported_length`:
    the engine's own mean where the counts were derived from it (TensorRT-LLM reports tokens
    per step, and the steps are rounded from it), else the mean is computed."""
    length = mean_acceptance_length(accepted, steps) if reported_length is None else reported_length
    attributes: dict[str, Any] = {
        "dflash.spec.steps": steps,
        "dflash.spec.accepted_tokens": accepted,
        "dflash.spec.mean_acceptance_length": length,
    }
    if drafted is not None:
        attributes["dflash.spec.draft_tokens"] = drafted
        attributes["dflash.spec.draft_acceptance_rate"] = draft_acceptance_rate(accepted, drafted)
    return attributes
