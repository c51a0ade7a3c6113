"""The nested objects of a request: which keys each may hold and which it must.

OpenAI refuses an unknown or a missing key anywhere in a request, naming its path
(`messages[0].content`); vLLM's TypedDicts drop unknown keys without a word, so a typo such
as `{"role": "user", "text": "hi"}` became an empty turn. The gateway checks these shapes
before anything else (and so does the embedded worker, whose request models are the
gateway's): what passes reaches a vLLM worker untouched. The accepted keys are OpenAI's plus
what vLLM 0.33 reads (`vllm/renderers/chat_utils/types.py`); `tests/wire/test_nested.py`
checks them against the installed vLLM. vLLM-only shapes that change between versions (a
`structural_tag` response format) pass unchecked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from wire.errors import InvalidRequest


@dataclass(frozen=True)
class Shape:
    """One JSON object: the keys it may hold, those it must, and the shapes of its object
    (or list of objects) values."""

    keys: frozenset[str]
    required: frozenset[str] = frozenset()
    children: Mapping[str, Shape] = field(default_factory=dict)


def shape(keys: str, required: str = "", **children: Shape) -> Shape:
    return Shape(frozenset(keys.split()), frozenset(required.split()), children)


def unknown_key(path: str, allowed: frozenset[str]) -> InvalidRequest:
    takes = ", ".join(sorted(allowed))
    return InvalidRequest(
        f"Unknown parameter: '{path}' (this object takes: {takes}).",
        param=path,
        code="unknown_parameter",
    )


def missing_key(path: str) -> InvalidRequest:
    return InvalidRequest(
        f"Missing required parameter: '{path}'.", param=path, code="missing_required_parameter"
    )


def check_object(value: object, spec: Shape, path: str) -> None:
    """400 for the first unknown or missing key in `value` or below. A value of the wrong
    type is left for the request model to report, in its own words."""
    if not isinstance(value, dict):
        return
    for key in value:
        if key not in spec.keys:
            raise unknown_key(f"{path}.{key}", spec.keys)
    for key in sorted(spec.required):
        if key not in value:
            raise missing_key(f"{path}.{key}")
    for key, child in spec.children.items():
        check_value(value.get(key), child, f"{path}.{key}")


def check_value(value: object, spec: Shape, path: str) -> None:
    """An object, or each object of a list."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            check_object(item, spec, f"{path}[{i}]")
    else:
        check_object(value, spec, path)


FUNCTION_CALL = shape("name arguments", "name arguments")
TOOL_CALL = shape(
    "id type function custom", "id type", function=FUNCTION_CALL, custom=shape("name input")
)
# Keys vLLM's CustomChatCompletionMessageParam reads on a message of any role.
VLLM_MESSAGE_KEYS = "name tool_call_id tool_calls reasoning tools task"
_CONTENT = f"role content {VLLM_MESSAGE_KEYS}"
MESSAGES: dict[str, Shape] = {
    "system": shape(_CONTENT, "role content", tool_calls=TOOL_CALL),
    "developer": shape(_CONTENT, "role content", tool_calls=TOOL_CALL),
    "user": shape(_CONTENT, "role content", tool_calls=TOOL_CALL),
    "tool": shape(_CONTENT, "role content", tool_calls=TOOL_CALL),
    "function": shape(_CONTENT, "role content", tool_calls=TOOL_CALL),
    # An assistant turn may be tool calls alone (OpenAI: content optional).
    "assistant": shape(
        f"{_CONTENT} refusal audio function_call",
        "role",
        tool_calls=TOOL_CALL,
        function_call=FUNCTION_CALL,
        audio=shape("id", "id"),
    ),
}
MEDIA_URL = shape("url detail", "url")
# Content parts by `type` (OpenAI's and vLLM's); `uuid` names a media item for vLLM's cache,
# `prompt_cache_breakpoint` is OpenAI's prompt-caching hint.
_CACHE = "prompt_cache_breakpoint"
PARTS: dict[str, Shape] = {
    "text": shape(f"type text {_CACHE}", "type text"),
    "refusal": shape("type refusal", "type refusal"),
    "image_url": shape(f"type image_url uuid {_CACHE}", "type image_url", image_url=MEDIA_URL),
    "input_audio": shape(
        f"type input_audio {_CACHE}",
        "type input_audio",
        input_audio=shape("data format", "data format"),
    ),
    "file": shape(f"type file {_CACHE}", "type file", file=shape("file_data file_id filename")),
    "audio_url": shape("type audio_url", "type audio_url", audio_url=shape("url", "url")),
    "video_url": shape("type video_url", "type video_url", video_url=shape("url", "url")),
    "image_embeds": shape("type image_embeds uuid", "type"),
    "audio_embeds": shape("type audio_embeds uuid", "type"),
    "video_embeds": shape("type video_embeds audio_embeds uuid", "type"),
    "prompt_embeds": shape("type data", "type data"),
    "thinking": shape("type thinking closed", "type thinking"),
    "tool_reference": shape("type name", "type"),
}
# vLLM's untyped shorthands: {"image_url": "https://..."} and its audio and video kin.
UNTYPED_PART = shape("image_url audio_url video_url uuid")

STREAM_OPTIONS = shape("include_usage continuous_usage_stats")
TOOL = shape(
    "type function custom",
    "type",
    function=shape("name description parameters strict", "name"),
    custom=shape("name description format", "name"),
)
TOOL_CHOICE = shape(
    "type function custom allowed_tools",
    "type",
    function=shape("name", "name"),
    custom=shape("name", "name"),
)
RESPONSE_FORMATS: dict[str, Shape] = {
    "text": shape("type"),
    "json_object": shape("type"),
    "json_schema": shape(
        "type json_schema", "type json_schema", json_schema=shape("name description schema strict")
    ),
}
PREDICTION = shape("type content", "type content")
AUDIO_OUTPUT = shape("voice format", "voice format")


def check_part(part: object, path: str) -> None:
    if not isinstance(part, dict):
        return
    kind = part.get("type")
    if kind is None and set(part) & UNTYPED_PART.keys:
        check_object(part, UNTYPED_PART, path)
        return
    if kind is None:
        raise missing_key(f"{path}.type")
    spec = PARTS.get(kind) if isinstance(kind, str) else None
    if spec is None:
        raise InvalidRequest(
            f"{path}.type: unknown content part type {kind!r} (one of: {', '.join(PARTS)}).",
            param=f"{path}.type",
        )
    check_object(part, spec, path)


def check_message(message: object, path: str) -> None:
    if not isinstance(message, dict):
        return
    role = message.get("role")
    if role is None:
        raise missing_key(f"{path}.role")
    spec = MESSAGES.get(role) if isinstance(role, str) else None
    if spec is None:
        return  # the request model names the bad role
    check_object(message, spec, path)
    content = message.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            check_part(part, f"{path}.content[{j}]")


def check_messages(messages: object, path: str = "messages") -> None:
    if isinstance(messages, list):
        for i, message in enumerate(messages):
            check_message(message, f"{path}[{i}]")


def check_chat_objects(payload: Mapping[str, Any]) -> None:
    """Every nested object of a chat request (the messages, tools and options)."""
    check_messages(payload.get("messages"))
    check_value(payload.get("tools"), TOOL, "tools")
    check_object(payload.get("tool_choice"), TOOL_CHOICE, "tool_choice")
    check_object(payload.get("prediction"), PREDICTION, "prediction")
    check_object(payload.get("audio"), AUDIO_OUTPUT, "audio")
    response_format = payload.get("response_format")
    if isinstance(response_format, dict):
        kind = response_format.get("type")
        if kind is None:
            raise missing_key("response_format.type")
        spec = RESPONSE_FORMATS.get(kind) if isinstance(kind, str) else None
        if spec is not None:  # vLLM's structural_tag and later kinds: vLLM's to check
            check_object(response_format, spec, "response_format")
