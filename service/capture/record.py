"""One captured request, from the raw bytes the proxy saw to a dataset sample (wire/capture.py).

Runs on the capture writer's thread, never on the event loop: the proxy hands over the bytes
it already had (the body it sent upstream, the worker's body or stream) and parses nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from service.reports import Usage, unwrap
from service.sse import event_json
from wire.capture import (
    SAMPLING_FIELDS,
    SCHEMA_VERSION,
    CapturedSample,
    dump_json,
    load_json,
    parse_sample,
)
from wire.responses import joined_text

# The proxy's endpoint paths as the dataset names them.
ENDPOINT_NAMES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
}


# Not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__,
# 1.3 µs of the event loop's time a captured request here (measured); nothing changes one
# after the proxy has made it. The proxy's parse of a unary reply is not handed over: it
# would save the writer 1.4 µs a sample but hold 3.3 KB in the queue for the bench's
# 534-byte reply, which the queue's bound, counted in bytes, would not see.
@dataclass(slots=True)
class RawCapture:
    """What the proxy hands over: its own bytes, unparsed, and who served the request."""

    endpoint: str  # the proxy's path
    request_body: bytes  # what went upstream
    reply: bytes  # the worker's JSON body, or its whole SSE stream
    stream: bool
    model: str
    pool: str
    tenant: str | None
    request_id: str
    time: float  # wall clock at the end
    # What the proxy already read from the reply, through the worker's adapter (so SGLang's
    # and TensorRT-LLM's fields count too): not read again here.
    usage: Usage | None = None
    acceptance_length: float | None = None

    @property
    def size(self) -> int:
        return len(self.request_body) + len(self.reply)


class Unusable(ValueError):
    """The request or reply holds nothing a drafter can learn from (counted, not raised on)."""


def sample_line(raw: RawCapture) -> bytes:
    """The dataset line of one served request (wire/capture.py); Unusable when it has no
    text to learn. Built as plain JSON values, not through CapturedSample: the dataclass and
    its `line()` cost the capture writer 1.7 of 7.3 µs a unary sample (measured)."""
    return dump_json(_record(raw))


def build_sample(raw: RawCapture) -> CapturedSample:
    """The sample of one served request as `dflash-train adapt` will read it."""
    return parse_sample(_record(raw), f"request {raw.request_id}")


def _record(raw: RawCapture) -> dict[str, Any]:
    request = _object(load_json(raw.request_body), "request body")
    endpoint = ENDPOINT_NAMES.get(raw.endpoint)
    if endpoint is None:
        raise Unusable(f"endpoint {raw.endpoint} is not captured")
    if raw.stream:
        reply = _stream_reply(raw.reply, endpoint, request)
    else:
        reply = _object(load_json(raw.reply), "reply")
    messages, prompt = _conversation(endpoint, request)
    completions = (
        _response_completions(reply) if endpoint == "responses" else _choice_completions(reply)
    )
    if not any(completion["text"] or completion["token_ids"] for completion in completions):
        raise Unusable("no completion text")
    usage = raw.usage
    tools, kwargs = request.get("tools"), request.get("chat_template_kwargs")
    return {  # the line's fields, in CapturedSample's order
        "schema": SCHEMA_VERSION,
        "id": raw.request_id,
        "time": raw.time,
        "endpoint": endpoint,
        "model": raw.model,
        "pool": raw.pool,
        "completions": completions,
        "messages": messages,
        "prompt": prompt,
        "tenant": raw.tenant,
        "tools": tools if isinstance(tools, list) else None,
        "chat_template_kwargs": kwargs if isinstance(kwargs, dict) else None,
        "sampling": {name: request[name] for name in SAMPLING_FIELDS if name in request},
        "usage": None if usage is None else vars(usage).copy(),
        "acceptance_length": raw.acceptance_length,
    }


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Unusable(f"the {what} is not a JSON object")
    return value


def _conversation(
    endpoint: str, request: dict[str, Any]
) -> tuple[list[dict[str, Any]] | None, str | None]:
    if endpoint == "completions":
        prompt = request.get("prompt")
        if not isinstance(prompt, str):
            raise Unusable("a completions prompt that is not one string")
        return None, prompt
    if endpoint == "chat":
        messages = request.get("messages")
        if not isinstance(messages, list):
            raise Unusable("no messages")
        return messages, None
    return _responses_messages(request), None


def _responses_messages(request: dict[str, Any]) -> list[dict[str, Any]]:
    """A Responses request's instructions and input as chat messages (the gateway has already
    validated the input: a string, or message items)."""
    instructions = request.get("instructions")
    messages = []
    if isinstance(instructions, str):
        messages.append({"role": "system", "content": instructions})
    items = request.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    for item in items if isinstance(items, list) else []:
        if isinstance(item, dict) and isinstance(item.get("role"), str):
            content = item.get("content")
            text = content if isinstance(content, str) else joined_text(content)
            messages.append({"role": item["role"], "content": text})
    if not messages:
        raise Unusable("no input")
    return messages


def _completion(text: str, token_ids: list[int] | None, reason: str | None) -> dict[str, Any]:
    return {"text": text, "token_ids": token_ids, "finish_reason": reason}


def _choice_completions(reply: dict[str, Any]) -> list[dict[str, Any]]:
    completions = []
    for choice in reply.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else choice.get("text")
        ids = choice.get("token_ids")
        completions.append(
            _completion(
                text if isinstance(text, str) else "",
                ids if ids and _token_ids(ids) else None,
                _reason(choice.get("finish_reason")),
            )
        )
    return completions


def _response_completions(reply: dict[str, Any]) -> list[dict[str, Any]]:
    response = unwrap(reply)
    if not isinstance(response, dict):
        return []
    text = "".join(
        joined_text(item.get("content"), "output_text")
        for item in response.get("output") or []
        if isinstance(item, dict) and item.get("type") == "message"
    )
    reason = "length" if response.get("status") == "incomplete" else "stop"
    return [_completion(text, None, reason)]


def _token_ids(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
    )


def _reason(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _stream_reply(stream: bytes, endpoint: str, request: dict[str, Any]) -> dict[str, Any]:
    """A stream folded into the body it stands for: each choice's text and token ids joined,
    and its finish reason; a Responses stream's terminal response. (Usage and speculation
    come from the proxy's own reading of the stream: RawCapture.)"""
    if b"\r" in stream:  # SSE allows CRLF and CR line ends too
        stream = stream.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    key = _TEXT_KEYS.get(endpoint)
    folded = _one_choice_stream(stream, key) if key and _one_choice(request) else None
    return folded or _every_event(stream)


# A one-choice chat or completions stream in compact JSON (vLLM's, SGLang's, the embedded
# worker's) is read without parsing its events: a stream has hundreds of small ones, and
# parsing each cost 8 µs an event, three times what relaying it costs the gateway. A key with
# its quotes cannot occur inside a JSON string (quotes there are escaped), so the text pieces
# are the `"content":"..."` (chat) or `"text":"..."` (completions) strings in order, decoded
# in one call. Any other shape (spaces after colons, several choices, a tool call, a
# Responses stream) goes to the full parse.
_STRING = rb'("[^"\\]*(?:\\.[^"\\]*)*")'
_TEXT_KEYS = {"chat": b"content", "completions": b"text"}
_PIECES = {key: re.compile(b'"' + key + b'":' + _STRING) for key in _TEXT_KEYS.values()}
_IDS = re.compile(rb'"token_ids":\[([0-9,]*)\]')


def _one_choice(request: dict[str, Any]) -> bool:
    """Whether the stream of this request has one choice and no tool call: what the
    request asked for decides it, not a scan of the stream (each scan of its bytes for a
    pattern that is absent cost 3-8 µs on a 64-event stream, a sixth of its capture)."""
    return request.get("n") in (None, 1) and not request.get("tools")


def _one_choice_stream(stream: bytes, key: bytes) -> dict[str, Any] | None:
    # Spaced JSON shows in the first event (one serializer writes a stream's events): its
    # keys would not match the patterns. A stream without choices is left to the full parse.
    data_at = stream.find(b"data:")
    if data_at < 0 or b'"choices"' not in stream:
        return None
    if b'": ' in stream[data_at : stream.find(b"\n", data_at)]:  # the first event
        return None
    with_ids = b'"token_ids"' in stream
    if with_ids and stream.count(b'"token_ids"') != stream.count(b'"token_ids":['):
        return None  # ids missing from some pieces: only the full parse can tell
    try:
        pieces = load_json(b"[" + b",".join(_PIECES[key].findall(stream)) + b"]")
        found_ids = _IDS.findall(stream) if with_ids else []
        ids = load_json(b"[" + b",".join(i for i in found_ids if i) + b"]")
    except ValueError:
        return None
    reason_at = stream.rfind(b'"finish_reason":"')
    reason = None
    if reason_at >= 0:
        begin = reason_at + len(b'"finish_reason":"')
        reason = stream[begin : stream.find(b'"', begin)].decode("utf-8", "replace")
    choice = {"text": "".join(pieces), "token_ids": ids if found_ids else None}
    return {"choices": [{**choice, "finish_reason": reason}]}


def _every_event(stream: bytes) -> dict[str, Any]:
    choices: dict[int, dict[str, Any]] = {}
    folded: dict[str, Any] = {}
    for obj in stream_events(stream):
        if not isinstance(obj, dict):
            continue
        if isinstance(obj.get("response"), dict) and str(obj.get("type", "")).startswith(
            "response."
        ):
            folded["response"] = obj["response"]  # the last one carries the whole output
        for choice in obj.get("choices") or ():
            if isinstance(choice, dict):
                _fold_choice(choices, choice)
    folded["choices"] = [choices[index] for index in sorted(choices)]
    for choice in folded["choices"]:
        choice["token_ids"] = choice["token_ids"] or None  # none seen: not returned
    return folded


def stream_events(stream: bytes) -> list[Any]:
    """Every JSON event of an SSE stream (not `[DONE]`), parsed in one call for them all
    as one array: a tenth of the CPU of one call per event (a stream has hundreds of small
    ones). An event that is not JSON makes it fall back to one call each, skipping it."""
    payloads = []
    for event in stream.split(b"\n\n"):
        data = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
        if data and data != [b"[DONE]"]:
            payloads.append(b"\n".join(data))
    try:
        events: list[Any] = load_json(b"[" + b",".join(payloads) + b"]")
        return events
    except ValueError:
        return [event_json(b"data: " + payload) for payload in payloads]


def _fold_choice(choices: dict[int, dict[str, Any]], choice: dict[str, Any]) -> None:
    index = choice.get("index", 0)
    index = index if isinstance(index, int) else 0
    into = choices.setdefault(index, {"text": "", "token_ids": [], "finish_reason": None})
    delta = choice.get("delta")
    piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    if isinstance(piece, str):
        into["text"] += piece
    ids = choice.get("token_ids")
    if _token_ids(ids) and into["token_ids"] is not None:
        into["token_ids"].extend(ids)
    elif ids is not None:
        into["token_ids"] = None  # one malformed piece: the ids cannot be trusted
    if choice.get("finish_reason") is not None:
        into["finish_reason"] = choice["finish_reason"]
