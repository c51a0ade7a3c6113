"""The Responses API's wire format: the `response` object and its typed stream events
(`openai.types.responses` names and shapes), with the per-request `metrics` object on the
response the way a chat completion carries it."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from engine.worker.formatting import usage
from wire.responses import ResponsesRequest, failed_event, message_id, typed_event

# Why a response stopped early, by the engine's finish reason (OpenAI's incomplete reasons).
INCOMPLETE = {"length": "max_output_tokens"}


def response_usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    """The chat completion's usage (formatting.usage) in the Responses API's names."""
    chat = usage(input_tokens, output_tokens)
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }


@dataclass
class ResponseFormatter:
    """Builds one request's response object and events, with a fixed id and time."""

    req: ResponsesRequest
    response_id: str
    model: str
    created_at: int = field(default_factory=lambda: int(time.time()))
    _seq: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def item_id(self) -> str:
        return message_id(self.response_id)

    @property
    def where(self) -> dict[str, Any]:
        """Where a text event belongs: the one message's one text part."""
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def message(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if status == "in_progress" and not text:
            content = []
        return {
            "id": self.item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        *,
        finish: str | None = None,
    ) -> dict[str, Any]:
        req = self.req
        reason = INCOMPLETE.get(finish or "")
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": "incomplete" if status == "completed" and reason else status,
            "error": None,  # a failed response: wire.responses.failed_event sets it
            "incomplete_details": {"reason": reason} if reason else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": self.model,
            "output": output,
            # As asked (vLLM 0.33 echoes it, default true); moot without tools.
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "store": False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": "none",
            "tools": [],
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
        }
        return body

    def event(self, kind: str, **fields: Any) -> bytes:
        return typed_event({"type": kind, "sequence_number": next(self._seq), **fields})

    def opening(self) -> bytes:
        """created, in_progress, the message item and its text part opened."""
        pending = self.response("in_progress", [])
        where = self.where
        return b"".join(
            (
                self.event("response.created", response=pending),
                self.event("response.in_progress", response=pending),
                self.event(
                    "response.output_item.added",
                    output_index=0,
                    item=self.message("", "in_progress"),
                ),
                self.event(
                    "response.content_part.added",
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                    **where,
                ),
            )
        )

    def delta(self, text: str) -> bytes:
        where = self.where
        return self.event("response.output_text.delta", delta=text, logprobs=[], **where)

    def closing(self, whole: dict[str, Any]) -> bytes:
        """The text, part and item done, then the terminal event (completed or incomplete)."""
        item = whole["output"][0]
        part = item["content"][0]
        where = self.where
        terminal = "response.completed" if whole["status"] == "completed" else "response.incomplete"
        return b"".join(
            (
                self.event("response.output_text.done", text=part["text"], logprobs=[], **where),
                self.event("response.content_part.done", part=part, **where),
                self.event("response.output_item.done", output_index=0, item=item),
                self.event(terminal, response=whole),
            )
        )

    def failed(self, code: str, message: str) -> bytes:
        """The terminal event of a stream that broke after its first byte."""
        return failed_event(self.response("failed", []), code, message, next(self._seq))
