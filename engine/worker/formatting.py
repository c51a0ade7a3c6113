"""Chat and completion bodies and stream chunks, plus vLLM's per-request `metrics` object: the
one place where the engine's request state becomes wire format. (The Responses API's objects
and events are responses_wire.py's.)"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.sequence import RequestMetrics, SpecDecodeStats, TokenLogprob
from engine.worker.schemas import Endpoint
from wire.speculation import draft_acceptance_rate, mean_acceptance_length

# A token id -> (its text, its bytes): engine.tokenizer.Tokenizer.logprob_token.
TokenNamer = Callable[[int], tuple[str, bytes]]
# What OpenAI and vLLM send for a log-probability of -inf (JSON has no infinity).
LOGPROB_FLOOR = -9999.0


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _ms(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    return (end - start) * 1000.0


def speculative_object(spec: SpecDecodeStats, level: str, *, stream: bool) -> dict[str, Any]:
    """vLLM's `speculative_decoding` object. `summary` leaves the per-step lists out of a
    stream's final chunk and sets them to null in a whole response, as vLLM does."""
    steps, accepted, drafted = spec.num_steps, spec.num_accepted, spec.num_drafted
    out: dict[str, Any] = {
        "mean_acceptance_length": mean_acceptance_length(accepted, steps),
        "draft_acceptance_rate": draft_acceptance_rate(accepted, drafted),
        "acceptance_histogram": spec.histogram(),
        "num_spec_steps": steps,
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": drafted,
        "num_spec_tokens": spec.num_spec_tokens,
    }
    if spec.adaptive:  # ours, beyond vLLM's object: what the adaptive policy chose
        out["num_plain_steps"] = spec.num_plain_steps
        out["mean_draft_tokens_per_step"] = drafted / steps if steps else 0.0
    if level == "detailed":
        out["per_step_accepted"] = list(spec.per_step_accepted)
        out["per_step_drafted"] = list(spec.per_step_drafted)
    elif not stream:
        out["per_step_accepted"] = None
        out["per_step_drafted"] = None
    return out


def metrics_object(metrics: RequestMetrics, level: str, *, stream: bool) -> dict[str, Any]:
    """vLLM's per-request `metrics` object, with vLLM's interval definitions: TTFT from
    first scheduling, generation time = first to last token, tokens/s over first scheduling
    to last token, mean ITL over the gaps (None for one token). Level `none` keeps the
    timings and leaves speculation out."""
    n = metrics.num_output_tokens
    decode_ms = _ms(metrics.first_token_time, metrics.last_token_time)
    inference_ms = _ms(metrics.first_scheduled_time, metrics.last_token_time)
    out: dict[str, Any] = {
        "time_to_first_token_ms": _ms(metrics.first_scheduled_time, metrics.first_token_time),
        "generation_time_ms": decode_ms,
        "queue_time_ms": _ms(metrics.arrival_time, metrics.first_scheduled_time),
        "mean_itl_ms": decode_ms / (n - 1) if decode_ms is not None and n > 1 else None,
        "tokens_per_second": (
            n / inference_ms * 1000.0 if inference_ms is not None and inference_ms > 0 else None
        ),
    }
    if metrics.spec is not None and level != "none":
        out["speculative_decoding"] = speculative_object(metrics.spec, level, stream=stream)
    return out


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


@dataclass
class CompletionFormatter:
    """Builds the bodies of one request, chat or completion, with a fixed id and time."""

    endpoint: Endpoint
    request_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    name_token: TokenNamer | None = None  # needed only when logprobs are asked for
    # Completions' text_offset runs on across a choice's stream chunks.
    _offsets: dict[int, int] = field(default_factory=dict)

    def logprobs(
        self, index: int, entries: Sequence[TokenLogprob | int] | None
    ) -> dict[str, Any] | None:
        """The `logprobs` object for these tokens of choice `index` (None if not asked):
        chat's `content` list (the top alternatives, most likely first) or completions'
        four parallel lists (the top alternatives plus the chosen token, keyed by text; a
        bare token id is a token nothing scored, the first of an echoed prompt: null)."""
        if entries is None:
            return None
        assert self.name_token is not None, "CompletionFormatter(name_token=...) for logprobs"
        name = self.name_token
        if self.endpoint == "chat":
            scored = [e for e in entries if isinstance(e, TokenLogprob)]
            return {"content": [self._chat_entry(e, name) for e in scored]}
        tokens, offsets = [], []
        values: list[float | None] = []
        top: list[dict[str, float] | None] = []
        offset = self._offsets.get(index, 0)
        for e in entries:
            text = name(e if isinstance(e, int) else e.token_id)[0]
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if isinstance(e, int):
                values.append(None)
                top.append(None)
                continue
            values.append(_logprob(e.logprob))
            alternatives = {name(t)[0]: _logprob(lp) for t, lp in e.top}
            top.append({text: _logprob(e.logprob), **alternatives})
        self._offsets[index] = offset
        return {
            "text_offset": offsets,
            "token_logprobs": values,
            "tokens": tokens,
            "top_logprobs": top,
        }

    @staticmethod
    def _chat_entry(entry: TokenLogprob, name: TokenNamer) -> dict[str, Any]:
        def one(token_id: int, logprob: float) -> dict[str, Any]:
            text, raw = name(token_id)
            return {"token": text, "logprob": _logprob(logprob), "bytes": list(raw)}

        top = [one(t, lp) for t, lp in entry.top]
        return {**one(entry.token_id, entry.logprob), "top_logprobs": top}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def role_chunk(self, index: int = 0) -> dict[str, Any]:
        """A chat choice's opening chunk, sent once its prompt is processed (as vLLM's)."""
        delta = {"role": "assistant", "content": ""}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        stop_reason: str | int | None = None,
        index: int = 0,
        logprobs: Sequence[TokenLogprob | int] | None = None,
    ) -> dict[str, Any]:
        ends = {"finish_reason": finish_reason, "stop_reason": stop_reason}
        lp = self.logprobs(index, logprobs)
        if self.endpoint == "chat":
            choice = {"index": index, "delta": {"content": text}, "logprobs": lp, **ends}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text, "logprobs": lp, **ends}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, use: dict[str, int], metrics: dict[str, Any] | None) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
        extra = {} if metrics is None else {"metrics": metrics}
        return {**self._head(obj), "choices": [], "usage": use, **extra}

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str,
        stop_reason: str | int | None,
        logprobs: Sequence[TokenLogprob | int] | None = None,
    ) -> dict[str, Any]:
        """One choice of a whole response."""
        ends = {"finish_reason": finish_reason, "stop_reason": stop_reason}
        lp = self.logprobs(index, logprobs)
        if self.endpoint == "chat":
            message = {"role": "assistant", "content": text}
            return {"index": index, "message": message, "logprobs": lp, **ends}
        return {"index": index, "text": text, "logprobs": lp, **ends}

    def body(
        self, choices: list[dict[str, Any]], use: dict[str, int], metrics: dict[str, Any] | None
    ) -> dict[str, Any]:
        """The whole (non-streamed) chat.completion or text_completion body."""
        obj = "chat.completion" if self.endpoint == "chat" else "text_completion"
        extra = {} if metrics is None else {"metrics": metrics}
        return {**self._head(obj), "choices": choices, "usage": use, **extra}
