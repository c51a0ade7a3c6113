"""Each engine's wire, adapted in one place, chosen by the pool's configured engine (never by
sniffing a response): what the gateway adds to a request for it, how its per-request
speculation becomes the same `dflash_*` series as vLLM's, what it adds to a response that the
client did not ask for, and where its queue length is on its Prometheus endpoint.

- vLLM (and the embedded worker, which speaks vLLM's wire): `metrics.speculative_decoding` on
  the response and on the final usage chunk of a stream.
- SGLang (>= 0.5.19; read from 0.5.23's `entrypoints/openai/serving_chat.py`,
  `serving_completions.py`, `protocol.py`): only a request with `return_spec_tokens_details:
  true` gets `sglext.spec_tokens_details` (a list when n > 1): top level of a response, and in a
  chunk of its own with `"choices": []` before the usage chunk of a stream. The gateway always
  asks, and drops it again for a client that did not. Its error bodies are top-level
  (`"object": "error"`): put under `error` as OpenAI's are. Queue: `sglang:num_queue_reqs`.
- TensorRT-LLM (the 1.3/1.4 pre-releases; `serve/openai_protocol.py`,
  `postprocess_handlers.py`): `avg_decoded_tokens_per_iter` (accepted drafts per step + 1) on
  every choice, on every content chunk of a stream as a running average. It refuses unknown
  request fields, so nothing is added. Queue: `trtllm_num_requests_waiting` at
  `/prometheus/metrics` (its `/metrics` is JSON).
"""

from __future__ import annotations

import json
from typing import Any, TypeGuard

from service.reports import SpecStats, Usage, parse_spec
from wire.speculation import draft_acceptance_rate, mean_acceptance_length

SGLANG_FLAG = "return_spec_tokens_details"
TRTLLM_FIELD = "avg_decoded_tokens_per_iter"


class Wire:
    """vLLM's wire: the reference every other engine is translated to."""

    name: str = "vllm"
    metrics_path: str = "/metrics"
    waiting_series: str = "vllm:num_requests_waiting"
    # Bytes that mark an SSE event carrying speculation besides the usage/metrics chunk.
    spec_marker: bytes | None = None

    def request_body(self, body: bytes) -> bytes:
        return body

    def spec_stats(self, body: Any, usage: Usage | None) -> list[SpecStats]:
        """Per-choice speculation of a response body (or of a stream's final events)."""
        return parse_spec(body)

    def strip(self, body: bytes, parsed: dict[str, Any], asked: bool) -> bytes:
        """The response body for a client: what only the gateway asked for, taken out."""
        return body

    def extra_event(self, event: dict[str, Any]) -> bool:
        """True for a stream event that only the gateway asked for."""
        return False

    def error_body(self, body: bytes) -> bytes:
        """A worker's 4xx body in OpenAI's shape ({"error": {...}}) for the client."""
        return body


class SglangWire(Wire):
    name = "sglang"
    waiting_series = "sglang:num_queue_reqs"
    spec_marker = b'"sglext"'

    def request_body(self, body: bytes) -> bytes:
        payload = json.loads(body)
        payload.setdefault(SGLANG_FLAG, True)  # a client's own value (true or false) stands
        return json.dumps(payload, separators=(",", ":")).encode()

    def spec_stats(self, body: Any, usage: Usage | None) -> list[SpecStats]:
        sglext = body.get("sglext") if isinstance(body, dict) else None
        details = sglext.get("spec_tokens_details") if isinstance(sglext, dict) else None
        entries = details if isinstance(details, list) else [details]
        return [stats for entry in entries if (stats := sglang_stats(entry)) is not None]

    def strip(self, body: bytes, parsed: dict[str, Any], asked: bool) -> bytes:
        sglext = parsed.get("sglext")
        if asked or not isinstance(sglext, dict) or "spec_tokens_details" not in sglext:
            return body
        rest = {key: value for key, value in sglext.items() if key != "spec_tokens_details"}
        cleaned = {**parsed, "sglext": rest} if rest else without(parsed, "sglext")
        return json.dumps(cleaned, separators=(",", ":")).encode()

    def extra_event(self, event: dict[str, Any]) -> bool:
        sglext = event.get("sglext")
        return (
            event.get("choices") == []
            and "usage" not in event
            and isinstance(sglext, dict)
            and set(sglext) == {"spec_tokens_details"}
        )

    def error_body(self, body: bytes) -> bytes:
        """SGLang answers `{"object": "error", "message", "type", "param", "code"}` at the top
        level (its ErrorResponse); OpenAI's clients read `{"error": {...}}`."""
        try:
            parsed = json.loads(body)
        except ValueError:
            return body
        if not isinstance(parsed, dict) or parsed.get("object") != "error" or "error" in parsed:
            return body
        fields = {key: parsed.get(key) for key in ("message", "type", "param", "code")}
        return json.dumps({"error": fields}, separators=(",", ":")).encode()


class TrtllmWire(Wire):
    name = "trtllm"
    metrics_path = "/prometheus/metrics"
    waiting_series = "trtllm_num_requests_waiting"
    spec_marker = b'"avg_decoded_tokens_per_iter"'

    def spec_stats(self, body: Any, usage: Usage | None) -> list[SpecStats]:
        """Steps and accepted drafts from the mean tokens per step and the completion tokens
        (every choice carries the request's value: counted once). The drafts proposed are not
        reported: no draft-token count and no acceptance rate come from TensorRT-LLM."""
        choices = body.get("choices") if isinstance(body, dict) else None
        values = [c.get(TRTLLM_FIELD) for c in choices or [] if isinstance(c, dict)]
        per_step = next((v for v in values if is_number(v) and v >= 1), None)
        if per_step is None or usage is None or usage.completion_tokens < 1:
            return []
        steps = max(1, round(usage.completion_tokens / per_step))
        accepted = max(0, usage.completion_tokens - steps)
        return [SpecStats(steps, None, accepted, float(per_step), None)]


def sglang_stats(entry: object) -> SpecStats | None:
    """SGLang's SpecTokensDetails in our terms: steps = verify steps, accepted = correct
    drafts, length = 1 + accepted / steps (SGLang's own spec_accept_length divides all the
    completion tokens, the prefill's first one included, by the steps: not comparable)."""
    if not isinstance(entry, dict):
        return None
    steps, accepted = entry.get("spec_verify_ct"), entry.get("spec_num_correct_drafts")
    proposed = entry.get("spec_num_proposed_drafts")
    if not is_count(steps) or not is_count(accepted) or not steps:
        return None
    drafted = proposed if is_count(proposed) else None
    rate = draft_acceptance_rate(accepted, drafted) if drafted else None
    return SpecStats(steps, drafted, accepted, mean_acceptance_length(accepted, steps), rate)


def is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def without(mapping: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in mapping.items() if k != key}


# By PoolSpec.engine (service/settings.py).
WIRES: dict[str, Wire] = {
    "vllm": Wire(),
    "embedded": Wire(),
    "sglang": SglangWire(),
    "trtllm": TrtllmWire(),
}
