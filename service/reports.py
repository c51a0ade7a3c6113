"""What workers report about one request, read defensively: `usage` and the per-request
speculation summary (`metrics.speculative_decoding`). Malformed parts are skipped, never raised:
the metrics, the tenants' charges and the engines' adapters all read these."""

from __future__ import annotations

import math
from dataclasses import dataclass

from wire.speculation import draft_acceptance_rate, mean_acceptance_length


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class SpecStats:
    """One request's speculation summary, as far as the worker reported it."""

    steps: int
    draft_tokens: int | None  # None: the engine does not report it (TensorRT-LLM)
    accepted_tokens: int
    acceptance_length: float | None
    acceptance_rate: float | None


def _count(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value < 0:
        return None
    return int(value)


def _ratio(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def unwrap(body: object) -> object:
    """The response object of a Responses stream event (response.completed, ...); any other
    body as it is."""
    if isinstance(body, dict) and isinstance(body.get("response"), dict):
        return body["response"]
    return body


def parse_usage(body: object) -> Usage | None:
    """`usage` of a response body or final chunk (chat's names or the Responses API's);
    None when missing or malformed."""
    body = unwrap(body)
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return None
    if "input_tokens" in usage or "output_tokens" in usage:
        prompt, completion = _count(usage.get("input_tokens")), _count(usage.get("output_tokens"))
    else:
        prompt = _count(usage.get("prompt_tokens"))
        completion = _count(usage.get("completion_tokens"))
    if prompt is None and completion is None:
        return None
    return Usage(prompt or 0, completion or 0)


def _histogram_counts(hist: object) -> dict[int, int]:
    """`acceptance_histogram` as {accepted: steps}: a list, or a sparse map with str/int keys."""
    items: list[tuple[object, object]] = []
    if isinstance(hist, list):
        items = list(enumerate(hist))
    elif isinstance(hist, dict):
        items = list(hist.items())
    counts: dict[int, int] = {}
    for key, value in items:
        index, count = (
            _count(int(key) if isinstance(key, str) and key.isdigit() else key),
            _count(value),
        )
        if index is not None and count:
            counts[index] = counts.get(index, 0) + count
    return counts


def _one_spec(spec: object) -> SpecStats | None:
    if not isinstance(spec, dict):
        return None
    hist = _histogram_counts(spec.get("acceptance_histogram"))
    steps = _count(spec.get("num_spec_steps"))
    accepted = _count(spec.get("num_accepted_draft_tokens"))
    drafted = _count(spec.get("num_draft_tokens"))
    steps = steps if steps is not None else sum(hist.values())
    accepted = accepted if accepted is not None else sum(k * v for k, v in hist.items())
    if drafted is None:
        per_step = _count(spec.get("num_spec_tokens"))
        drafted = steps * per_step if per_step is not None else 0
    length = _ratio(spec.get("mean_acceptance_length"))
    if length is None and steps:
        length = mean_acceptance_length(accepted, steps)
    rate = _ratio(spec.get("draft_acceptance_rate"))
    if rate is None and drafted:
        rate = draft_acceptance_rate(accepted, drafted)
    if not steps and length is None:
        return None
    return SpecStats(steps, drafted, accepted, length, rate)


def parse_spec(body: object) -> list[SpecStats]:
    """`metrics.speculative_decoding` of a body or final chunk: missing, null, or a list per
    choice (n > 1) all parse; what is malformed is skipped, never raised."""
    body = unwrap(body)
    metrics = body.get("metrics") if isinstance(body, dict) else None
    entries = metrics if isinstance(metrics, list) else [metrics]
    found = []
    for entry in entries:
        if isinstance(entry, dict):
            stats = _one_spec(entry.get("speculative_decoding"))
            if stats is not None:
                found.append(stats)
    return found


def decode_speed(body: object) -> float | None:
    """A request's decode tokens/s as its worker measured it (the `metrics` object's
    `tokens_per_second`, else 1000 / `mean_itl_ms`); None when not reported."""
    body = unwrap(body)
    metrics = body.get("metrics") if isinstance(body, dict) else None
    if isinstance(metrics, list):  # n > 1: one per choice, the first stands for the request
        metrics = metrics[0] if metrics else None
    if not isinstance(metrics, dict):
        return None
    speed = _ratio(metrics.get("tokens_per_second"))
    if speed:
        return speed
    itl = _ratio(metrics.get("mean_itl_ms"))
    return 1000.0 / itl if itl else None
