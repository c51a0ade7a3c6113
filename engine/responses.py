"""OpenAI response bodies and stream chunks, plus vLLM 0.33's per-request `metrics` object."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from engine.protocol import Endpoint
from engine.sequence import RequestMetrics


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def metrics_object(metrics: RequestMetrics, level: str) -> dict[str, Any]:
    """The `metrics` object; `none` keeps the timings and leaves speculation out (as vLLM)."""
    out = metrics.to_vllm("detailed" if level == "detailed" else "summary")
    if level == "none":
        out.pop("speculative_decoding", None)
    return out


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class Formatter:
    """Builds the bodies of one request, chat or completion, with a fixed id and time."""

    endpoint: Endpoint
    request_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str, finish_reason: str | None, *, first: bool = False) -> dict[str, Any]:
        if self.endpoint == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first \
                else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, use: dict[str, int], metrics: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": use, "metrics": metrics}

    def response(
        self, text: str, finish_reason: str, use: dict[str, int], metrics: dict[str, Any]
    ) -> dict[str, Any]:
        if self.endpoint == "chat":
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "logprobs": None,
                      "finish_reason": finish_reason}
            head = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            head = self._head("text_completion")
        return {**head, "choices": [choice], "usage": use, "metrics": metrics}
