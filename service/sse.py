"""Reading a worker's Server-Sent Events on the fly, without holding the stream back."""

from __future__ import annotations

import json
import time
from typing import Any


def carries_tokens(choices: object) -> bool:
    """True for a chunk with generated text (not the role-only opening chunk of a chat)."""
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and (
            delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
        ):
            return True
    return False


class SseTap:
    """Splits upstream bytes at event boundaries, notes first-token time, usage and metrics,
    and drops the usage-only final chunk when the client did not ask for it.

    Complete events go out the moment they are complete; bytes are forwarded unchanged.
    """

    def __init__(self, *, strip_usage_chunk: bool) -> None:
        self._strip = strip_usage_chunk
        self._pending = b""
        self.first_token_at: float | None = None
        self.final: dict[str, Any] | None = None  # the chunk carrying usage (and metrics)
        self.done = False
        self.errored = False

    def feed(self, data: bytes) -> bytes:
        """Bytes to send to the client now (maybe empty while an event is incomplete)."""
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        buf = self._pending + data if self._pending else data
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._pending = buf
            return b""
        complete, self._pending = buf[: end + 2], buf[end + 2 :]
        events = complete[:-2].split(b"\n\n")
        keep = [event for event in events if self._inspect(event)]
        if len(keep) == len(events):
            return complete
        return b"".join(event + b"\n\n" for event in keep)

    def _inspect(self, event: bytes) -> bool:
        """Record what the event says; False when it must not reach the client."""
        lines = [line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")]
        if not lines:
            return True
        payload = b"\n".join(lines)
        if payload == b"[DONE]":
            self.done = True
            return True
        try:
            obj = json.loads(payload)
        except ValueError:
            return True
        if not isinstance(obj, dict):
            return True
        if "error" in obj:
            self.errored = True
        choices = obj.get("choices")
        if self.first_token_at is None and carries_tokens(choices):
            self.first_token_at = time.perf_counter()
        if obj.get("usage") is not None or obj.get("metrics") is not None:
            self.final = obj
            if choices == [] and self._strip:
                return False
        return True
