"""Reading a worker's Server-Sent Events on the fly, without holding the stream back."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

from service.routing.engines import WIRES, Wire

# The terminal events of a Responses API stream (as JSON values: a quoted type in generated
# text is escaped, so it cannot match).
RESPONSE_ENDS = (b'"response.completed"', b'"response.incomplete"', b'"response.failed"')


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
            delta.get("content")
            or delta.get("reasoning")  # vLLM >= 0.32 streams reasoning under this name
            or delta.get("reasoning_content")
            or delta.get("tool_calls")
        ):
            return True
    return False


class SseTap:
    """Splits upstream bytes at event boundaries, notes first-token time, usage and metrics,
    and drops the usage-only final chunk when the client did not ask for it.

    Complete events go out the moment they are complete; bytes are forwarded unchanged,
    whichever line ends (CRLF, CR or LF) the worker uses, wherever its reads split them.
    """

    def __init__(
        self,
        *,
        strip_usage_chunk: bool,
        wire: Wire = WIRES["vllm"],
        keep_extra: bool = True,
        rewrite: Callable[[bytes], bytes] | None = None,
        collect_finish_reasons: bool = False,
        record_limit: int = 0,
    ) -> None:
        self._strip = strip_usage_chunk
        # Responses API streams: events carrying the response object are rewritten
        # (service/responses.py), and the terminal event ends the stream (no [DONE]).
        self._rewrite = rewrite
        self.events = 0
        self._wire, self._keep_extra, self._marker = wire, keep_extra, wire.spec_marker
        self._pending = b""
        self._lf_owed = False  # the last event ended on a CR at the end of a read
        self._last_kept = True  # whether that event went to the client
        self._final_raw: bytes | None = None  # last event carrying usage / metrics
        self._final_parsed: tuple[bytes | None, dict[str, Any] | None] = (None, None)
        self._spec_raw: bytes | None = None  # last event with the engine's speculation
        self.first_token_at: float | None = None
        self.done = False
        self.errored = False
        # The choices' finish reasons, collected for a traced request only (untraced streams
        # pay nothing). Two byte counts per event; the regex runs only on an event where some
        # finish_reason is not a compact `null` (the last one of each choice).
        self.finish_reasons: list[str] | None = [] if collect_finish_reasons else None
        # The worker's bytes as they came, for capture (service/capture/): one append per
        # read, parsed later on the capture thread. None when not capturing, or once the
        # stream outgrew record_limit (it is then not captured).
        self.recording: list[bytes] | None = [] if record_limit > 0 else None
        self._record_room = record_limit

    @property
    def final(self) -> dict[str, Any] | None:
        """The last chunk with usage (and metrics), parsed once, at the end."""
        if self._final_raw is None:
            return None
        if self._final_parsed[0] is not self._final_raw:  # parsed once per final chunk
            obj = event_json(self._final_raw)
            self._final_parsed = (self._final_raw, obj if isinstance(obj, dict) else None)
        return self._final_parsed[1]

    @property
    def spec_event(self) -> dict[str, Any] | None:
        """The last event carrying the engine's own speculation fields (not vLLM's)."""
        obj = event_json(self._spec_raw) if self._spec_raw is not None else None
        return obj if isinstance(obj, dict) else None

    def feed(self, data: bytes) -> bytes:
        """Bytes to send to the client now (maybe empty while an event is incomplete)."""
        if self.recording is not None:
            self._record(data)
        head = b""
        if self._lf_owed:  # the last read ended an event on a CR: a LF now completes its CRLF
            self._lf_owed = False
            if data.startswith(b"\n"):
                head, data = (b"\n" if self._last_kept else b""), data[1:]
        buf = self._pending + data if self._pending else data
        if b"\r" in buf:
            return head + self._feed_any_line_ends(buf)
        # The common case, LF line ends only: one search for the last blank line.
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._pending = buf
            return head
        complete, self._pending = buf[: end + 2], buf[end + 2 :]
        events = complete[:-2].split(b"\n\n")
        keep = [event for event in events if self._inspect(event)]
        self.events += len(events)
        if self._rewrite is not None:
            rewrite = self._rewrite
            keep = [rewrite(e) if b'"response":{' in e else e for e in keep]
        elif len(keep) == len(events):
            return head + complete
        return head + b"".join(event + b"\n\n" for event in keep)

    def _record(self, data: bytes) -> None:
        self._record_room -= len(data)
        if self._record_room < 0:
            self.recording = None
        else:
            self.recording.append(data)  # type: ignore[union-attr]

    @property
    def recorded(self) -> bytes | None:
        return None if self.recording is None else b"".join(self.recording)

    def _feed_any_line_ends(self, buf: bytes) -> bytes:
        """`feed` for a buffer with CRs in it: SSE ends a line with CRLF, CR or LF, and an
        event with an empty line. Each event's own bytes go out unchanged."""
        out: list[bytes] = []
        start = 0
        for boundary in EVENT_END.finditer(buf):
            event, raw = buf[start : boundary.start()], buf[start : boundary.end()]
            start = boundary.end()
            if not event:  # an empty line alone dispatches nothing
                out.append(raw)
                self._last_kept = True
                continue
            self.events += 1
            self._last_kept = self._inspect(event)
            if not self._last_kept:
                continue
            if self._rewrite is not None and b'"response":{' in event:
                raw = self._rewrite(event) + buf[boundary.start() : boundary.end()]
            out.append(raw)
        self._pending = buf[start:]
        # A CR that ends the buffer and an event may be the first half of a CRLF.
        self._lf_owed = start == len(buf) and start > 0 and buf.endswith(b"\r")
        return b"".join(out)

    def _inspect(self, event: bytes) -> bool:
        """Record what the event says; False when it must not reach the client.

        Cheap byte checks first: once the first token is seen, only the rare events (usage
        only, errors) are parsed; the usage chunk itself is parsed once, at the end."""
        if event[:1] in (b"\n", b"\r"):  # blank lines before it (legal SSE): not the event
            event = event.lstrip(b"\r\n")
        if event.startswith((b"data: [DONE]", b"data:[DONE]")) or (
            self._rewrite is not None and any(end in event for end in RESPONSE_ENDS)
        ):
            self.done = True
            if self._rewrite is None:
                return True
        usage_only = b'"choices":[]' in event or b'"choices": []' in event
        if b'"usage"' in event or b'"metrics"' in event:
            self._final_raw = event
        if self._marker is not None and self._marker in event:
            self._spec_raw = event
        if self.finish_reasons is not None and event.count(FINISH_KEY) != event.count(NO_FINISH):
            self.finish_reasons.extend(r.decode() for r in FINISH_REASON.findall(event))
        if self.first_token_at is not None and not usage_only and b'"error"' not in event:
            return True
        obj = event_json(event)
        if not isinstance(obj, dict):
            return True
        if "error" in obj:
            self.errored = True
        choices = obj.get("choices")
        if self.first_token_at is None and (
            carries_tokens(choices)
            or (obj.get("type") == "response.output_text.delta" and obj.get("delta"))
        ):
            self.first_token_at = time.perf_counter()
        if usage_only and not self._keep_extra and self._wire.extra_event(obj):
            return False  # asked for by the gateway alone
        return not (usage_only and choices == [] and self._strip and "usage" in obj)


# An event ends at an empty line: two line ends in a row, each CRLF, CR or LF. A CR at the
# end of the buffer counts as a line end (feed settles a LF that follows it in the next read).
EVENT_END = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?!\n)|\n)")
LINE_END = re.compile(rb"\r\n|\r|\n")
FINISH_REASON = re.compile(rb'"finish_reason":\s*"([A-Za-z_]+)"')
FINISH_KEY, NO_FINISH = b'"finish_reason"', b'"finish_reason":null'


def event_json(event: bytes) -> Any:
    split = LINE_END.split(event) if b"\r" in event else event.split(b"\n")
    lines = [line[5:].lstrip() for line in split if line.startswith(b"data:")]
    try:
        return json.loads(b"\n".join(lines)) if lines else None
    except ValueError:
        return None
