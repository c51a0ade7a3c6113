"""OpenAI's Responses API request, as the gateway and the embedded worker both read it.

Strict, and closed: a field that is not one of OpenAI's create-response fields is a 400
naming it (the gateway rebuilds the body it sends upstream, so nothing unknown may pass).
Input items are messages only (roles user, system, developer, assistant; `input_text` and
`output_text` parts): the conversation a stored response continues is kept as such items.
Fields the gateway forwards without reading (`tools`, `reasoning`, ...) are typed loosely
here; the embedded worker refuses them unless they ask for nothing (engine/worker/
responses_api.py), a vLLM worker reads them itself.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from wire.schemas import INTEGRAL, Count, StopString

_CLOSED = ConfigDict(extra="forbid", strict=True)
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class TextPart(BaseModel):
    """`input_text` (what a user, system or developer says) or `output_text` (a model's
    earlier answer fed back). Annotations and logprobs are output-only details: an earlier
    answer may carry them empty, never with content the model would have to read."""

    model_config = _CLOSED
    type: Literal["input_text", "output_text"]
    text: str
    annotations: Annotated[list[Any], Field(max_length=0)] | None = None
    logprobs: Annotated[list[Any], Field(max_length=0)] | None = None


class MessageItem(BaseModel):
    """One message of the conversation: OpenAI's EasyInputMessage, its input message item and
    its output message item (as a client sends an earlier output back)."""

    model_config = _CLOSED
    type: Literal["message"] | None = None
    id: Annotated[str, Field(max_length=256)] | None = None
    status: ItemStatus | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: list[TextPart] | str


class TextFormat(BaseModel):
    model_config = _CLOSED
    type: Literal["text", "json_object", "json_schema"]
    # json_schema's own fields (a vLLM worker honours them; the embedded worker refuses).
    name: Annotated[str, Field(max_length=64)] | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = _CLOSED
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class ResponsesRequest(BaseModel):
    """POST /v1/responses. The forwarded-only fields are listed one by one (a closed model);
    their rules are the engine's."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        populate_by_name=True,
        json_schema_extra={
            "examples": [{"model": "tiny-coder", "input": "def fib(n):", "max_output_tokens": 8}]
        },
    )
    model: Annotated[str, Field(min_length=1, max_length=256)]
    input: Annotated[list[MessageItem], Field(min_length=1)] | Annotated[str, Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None
    text: TextConfig | None = None
    store: bool | None = None
    previous_response_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    user: str | None = None
    # vLLM's extension of the Responses request (its ResponsesRequest, 0.32): honoured by the
    # embedded worker as in chat; OpenAI's Responses API has no stop strings.
    stop: StopString | list[StopString] | None = None
    # Forwarded to the worker as given (see the module's docstring).
    background: bool | None = None
    context_management: Any = None
    conversation: Any = None
    include: list[str] | None = None
    max_tool_calls: Any = None
    moderation: Any = None
    parallel_tool_calls: bool | None = None
    prompt: Any = None
    prompt_cache_key: str | None = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    reasoning: Any = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    stream_options: Any = None
    tool_choice: Any = None
    tools: list[Any] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20), INTEGRAL] | None = None
    truncation: Literal["auto", "disabled"] | None = None

    def input_items(self) -> list[dict[str, Any]]:
        """The input as message items with parts (a string is one user message)."""
        if isinstance(self.input, str):
            return [message_item("user", "input_text", self.input)]
        return [normal_item(item) for item in self.input]

    def text_format(self) -> str:
        fmt = self.text.format if self.text is not None else None
        return "text" if fmt is None else fmt.type


def typed_event(event: dict[str, Any]) -> bytes:
    """One stream event as OpenAI writes it: an `event:` line naming its type, then data."""
    kind: str = event["type"]
    data = json.dumps(event, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


def failed_event(response: dict[str, Any], code: str, message: str, sequence: int) -> bytes:
    """A stream's `response.failed` event: the response it carried, failed with an error
    (the gateway's when a worker's stream breaks, the worker's when its engine fails)."""
    failed = {**response, "status": "failed", "error": {"code": code, "message": message}}
    return typed_event({"type": "response.failed", "sequence_number": sequence, "response": failed})


def message_id(response_id: str, index: int | None = None) -> str:
    """The id of a message of response `resp_X`: `msg_X` (its output), `msg_X_i` (its i-th
    input item, as the input_items listing names them)."""
    stem = response_id.removeprefix("resp_")
    return f"msg_{stem}" if index is None else f"msg_{stem}_{index}"


def joined_text(parts: object, part_type: str | None = None) -> str:
    """The text of a message's content parts (of one type only, when given); what is not a
    text part is skipped."""
    if not isinstance(parts, list):
        return ""
    return "".join(
        part.get("text", "")
        for part in parts
        if isinstance(part, dict) and (part_type is None or part.get("type") == part_type)
    )


def message_item(role: str, part_type: str, text: str) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": part_type, "text": text}]}


def normal_item(item: MessageItem) -> dict[str, Any]:
    """A message item in the one shape the gateway stores and forwards: type, role, parts."""
    if isinstance(item.content, str):
        kind = "output_text" if item.role == "assistant" else "input_text"
        return message_item(item.role, kind, item.content)
    parts = [{"type": part.type, "text": part.text} for part in item.content]
    return {"type": "message", "role": item.role, "content": parts}


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The conversation as chat messages (instructions first, as a system message): what the
    embedded worker runs through the chat template. Developer messages are system messages,
    as in chat completions."""
    messages = [] if instructions is None else [{"role": "system", "content": instructions}]
    for item in items:
        messages.append({"role": item["role"], "content": joined_text(item["content"])})
    return messages
