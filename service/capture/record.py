"""One captured request, from the raw bytes the proxy saw to a dataset sample (wire/capture.py).

Runs on the capture writer's thread, never on the event loop: the proxy hands over the bytes
it already had (the body it sent upstream, the worker's body or stream) and parses nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from service.reports import parse_spec, parse_usage, unwrap
from service.sse import EVENT_END, event_json
from wire.capture import SAMPLING_FIELDS, CapturedCompletion, CapturedSample
from wire.responses import joined_text

# The proxy's endpoint paths as the dataset names them.
ENDPOINT_NAMES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
}


@dataclass(frozen=True)
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

    @property
    def size(self) -> int:
        return len(self.request_body) + len(self.reply)


class Unusable(ValueError):
    """The request or reply holds nothing a drafter can learn from (counted, not raised on)."""


def build_sample(raw: RawCapture) -> CapturedSample:
    """The dataset sample of one served request; Unusable when it has no text to learn."""
    request = _object(json.loads(raw.request_body), "request body")
    reply = _stream_reply(raw.reply) if raw.stream else _object(json.loads(raw.reply), "reply")
    endpoint = ENDPOINT_NAMES.get(raw.endpoint)
    if endpoint is None:
        raise Unusable(f"endpoint {raw.endpoint} is not captured")
    messages, prompt = _conversation(endpoint, request)
    completions = (
        _response_completions(reply) if endpoint == "responses" else _choice_completions(reply)
    )
    if not any(completion.text or completion.token_ids for completion in completions):
        raise Unusable("no completion text")
    usage = parse_usage(reply)
    spec = parse_spec(reply)
    tools, kwargs = request.get("tools"), request.get("chat_template_kwargs")
    return CapturedSample(
        id=raw.request_id,
        time=raw.time,
        endpoint=endpoint,
        model=raw.model,
        pool=raw.pool,
        tenant=raw.tenant,
        messages=messages,
        prompt=prompt,
        tools=tools if isinstance(tools, list) else None,
        chat_template_kwargs=kwargs if isinstance(kwargs, dict) else None,
        sampling={name: request[name] for name in SAMPLING_FIELDS if name in request},
        completions=completions,
        usage=None if usage is None else vars(usage).copy(),
        acceptance_length=spec[0].acceptance_length if spec else None,
    )


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


def _choice_completions(reply: dict[str, Any]) -> list[CapturedCompletion]:
    completions = []
    for choice in reply.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else choice.get("text")
        ids = choice.get("token_ids")
        completions.append(
            CapturedCompletion(
                text if isinstance(text, str) else "",
                ids if ids and _token_ids(ids) else None,
                _reason(choice.get("finish_reason")),
            )
        )
    return completions


def _response_completions(reply: dict[str, Any]) -> list[CapturedCompletion]:
    response = unwrap(reply)
    if not isinstance(response, dict):
        return []
    text = "".join(
        joined_text(item.get("content"), "output_text")
        for item in response.get("output") or []
        if isinstance(item, dict) and item.get("type") == "message"
    )
    reason = "length" if response.get("status") == "incomplete" else "stop"
    return [CapturedCompletion(text, None, reason)]


def _token_ids(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
    )


def _reason(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _stream_reply(stream: bytes) -> dict[str, Any]:
    """A stream folded into the body it stands for: each choice's text and token ids joined,
    its finish reason, the last usage and metrics; a Responses stream's terminal response."""
    choices: dict[int, dict[str, Any]] = {}
    folded: dict[str, Any] = {}
    for event in EVENT_END.split(stream):
        obj = event_json(event)
        if not isinstance(obj, dict):
            continue
        if isinstance(obj.get("response"), dict) and str(obj.get("type", "")).startswith(
            "response."
        ):
            folded["response"] = obj["response"]  # the last one carries the whole output
        for key in ("usage", "metrics"):
            if obj.get(key) is not None:
                folded[key] = obj[key]
        for choice in obj.get("choices") or []:
            if isinstance(choice, dict):
                _fold_choice(choices, choice)
    folded["choices"] = [choices[index] for index in sorted(choices)]
    return folded


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
