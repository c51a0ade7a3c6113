"""One request's trace at the embedded worker (docs/tracing.md): a server span continuing
the gateway's traceparent, and below it, for each sequence, its queueing, prefill and decoding,
built after the fact from the engine's own timestamps and speculation counts (the engine core
knows nothing of tracing; there is no span per step)."""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from engine.sequence import RequestMetrics, RequestOutput, SpecDecodeStats
from wire.speculation import spec_span_attributes
from wire.tracing import operation

if TYPE_CHECKING:
    from wire.otel import Tracing


def epoch_ns(monotonic_s: float, offset_ns: int) -> int:
    return int(monotonic_s * 1e9) + offset_ns


def decoding_attributes(spec: SpecDecodeStats | None, output_tokens: int) -> dict[str, Any]:
    """The decode span's summary: steps, drafts proposed and accepted, and for the adaptive
    policy how often it chose each draft length (and plain steps)."""
    attributes: dict[str, Any] = {"gen_ai.usage.output_tokens": output_tokens}
    if spec is None:
        return attributes
    attributes.update(spec_span_attributes(spec.num_steps, spec.num_accepted, spec.num_drafted))
    attributes["dflash.spec.num_spec_tokens"] = spec.num_spec_tokens
    attributes["dflash.spec.adaptive"] = spec.adaptive
    if spec.adaptive:
        chosen = Counter(spec.per_step_drafted)
        attributes["dflash.adaptive.plain_steps"] = spec.num_plain_steps
        # "k=count" per draft length the policy chose, shortest first.
        attributes["dflash.adaptive.draft_lengths"] = [f"{k}={chosen[k]}" for k in sorted(chosen)]
    return attributes


class WorkerTrace:
    """The spans of one request at the worker; the server span ends with its last sequence."""

    def __init__(
        self,
        tracing: Tracing,
        route: str,
        model: str,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        self.tracing = tracing
        self.server = tracing.start(
            f"POST {route}",
            tracing.extract(headers),
            "server",
            {
                "http.request.method": "POST",
                "http.route": route,
                "gen_ai.operation.name": operation(route),
                "gen_ai.request.model": model,
            },
        )
        self.open = 0
        self.ended = False

    def track(self) -> None:
        """One more sequence (n choices, or one per prompt) belongs to the request."""
        self.open += 1

    def sequence_done(self, out: RequestOutput | None, index: int) -> None:
        """A sequence ended (finished, or aborted: `out` is its last output, if any)."""
        if out is not None:
            self._phases(out.metrics, index, out.finish_reason)
        self.open -= 1
        if self.open <= 0:
            self.end()

    def _phases(self, m: RequestMetrics, index: int, reason: str | None) -> None:
        """queue (arrival to first schedule), prefill (to the first token), decode (to the
        end): from the engine's monotonic timestamps, placed on the wall clock."""
        offset = time.time_ns() - time.monotonic_ns()
        end = m.finished_time if m.finished_time is not None else time.monotonic()
        marks = [m.arrival_time, m.first_scheduled_time, m.first_token_time, end]
        names = ("queue", "prefill", "decode")
        for i, name in enumerate(names):
            start, stop = marks[i], marks[i + 1]
            if start is None or stop is None:
                break
            attributes: dict[str, Any] = {"dflash.sequence": index}
            if name == "decode":
                attributes.update(decoding_attributes(m.spec, m.num_output_tokens))
                if reason is not None:
                    attributes["gen_ai.response.finish_reasons"] = [reason]
            span = self.tracing.start(
                name, self.server, attributes=attributes, start_time=epoch_ns(start, offset)
            )
            span.end(epoch_ns(stop, offset))

    def failed(self, status: int, code: str, message: str) -> None:
        if self.ended:  # its sequences were withdrawn first: nothing more to say
            return
        attributes = {"http.response.status_code": status, "error.type": code}
        self.tracing.fail(self.server, message, attributes)
        self.end()

    def usage(self, prompt_tokens: int) -> None:
        self.server.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.server.end()
