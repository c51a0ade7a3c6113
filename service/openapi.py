"""The gateway's OpenAPI document, made to say what the gateway does: the request models'
schemas with the nested rules the validation enforces (wire/nested.py's shapes become the
declared message schemas), the error statuses every operation can answer with their OpenAI
error body, and /metrics as Prometheus text. FastAPI's 422 is never sent (a bad request is a
400 here), so it is not declared.

The document served at /openapi.json also says what the healthy workers serve (`served`):
counts of tokens at most the longest context (their /v1/models cards' `max_model_len`),
token ids under the vocabulary (`vocab_size`, which the embedded worker's card gives), and,
when only embedded workers serve, of each Responses field the embedded engine refuses only
the values that ask for nothing. What no schema can say (a prompt that alone fills the
context, counted in tokens) stays a 400 naming it."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST

from wire.nested import MESSAGES, PARTS, UNTYPED_PART, Shape
from wire.refused import CHAT_ROLES, MESSAGE_REFUSED, RESPONSES_REFUSED, RESPONSES_TEXT_FORMATS
from wire.responses import ResponsesRequest

if TYPE_CHECKING:
    from service.api import Runtime

from wire.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

REQUEST_MODELS = (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    DetokenizeRequest,
    ResponsesRequest,
)
ERROR_BODY = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
ERRORS = {
    "400": "Bad request: the body or a parameter is invalid (the error names it)",
    "401": "Missing or unknown API key",
    "404": "Unknown model, route or stored response",
    "405": "Method not allowed on this route",
    "413": "The body is over the size limit",
    "429": "The tenant's rate limit or quota is spent",
    "499": "The client closed the connection",
    "500": "Internal error",
    "502": "The worker failed",
    "503": "No healthy worker, every worker busy, or draining",
    "504": "The worker did not answer in time",
}
STREAMING = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
PROMETHEUS_TEXT = CONTENT_TYPE_LATEST  # what the gateway sends (prometheus_client)


def shape_schema(spec: Shape, fixed: dict[str, Any]) -> dict[str, Any]:
    """A nested.py shape as JSON Schema: its keys, its required keys, nothing else."""
    properties: dict[str, Any] = {key: {} for key in sorted(spec.keys)}
    for key, child in spec.children.items():
        # check_value: an object must match, so must the objects of a list; other values are
        # the request model's to type (and the models here leave these keys untyped).
        one = shape_schema(child, {})
        not_object = {"not": {"type": "object"}}
        listed = {"type": "array", "items": {"anyOf": [one, not_object]}}
        properties[key] = {"anyOf": [one, listed, {"not": {"type": ["object", "array"]}}]}
    properties.update(fixed)
    out = {"type": "object", "properties": properties, "additionalProperties": False}
    return {**out, "required": sorted(spec.required)} if spec.required else out


NAME = {"type": ["string", "null"]}  # ChatMessage.name's type


def message_schema() -> dict[str, Any]:
    """ChatMessage as validated: one shape per role, content a string, parts or null."""
    parts = [shape_schema(spec, {"type": {"const": kind}}) for kind, spec in PARTS.items()]
    # check_part: a part without `type` must hold one of vLLM's untyped shorthand keys.
    untyped = shape_schema(UNTYPED_PART, {})
    untyped["anyOf"] = [{"required": [key]} for key in sorted(UNTYPED_PART.keys)]
    parts.append(untyped)
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": parts}}]}
    content["anyOf"].append({"type": "null"})
    return {
        "oneOf": [
            shape_schema(spec, {"role": {"const": role}, "content": content, "name": NAME})
            for role, spec in MESSAGES.items()
        ]
    }


def tokenize_schema(definition: dict[str, Any]) -> dict[str, Any]:
    """Exactly one of prompt and messages, as TokenizeRequest's validator says."""
    prompt = {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}}
    messages = {"required": ["messages"], "properties": {"messages": {"type": "array"}}}
    return {**definition, "oneOf": [prompt, messages]}


# Cross-field rules of the request models, as JSON Schema (each: one of these holds).
STREAM_OPTIONS_NEED_STREAM = {
    "anyOf": [
        {"required": ["stream"], "properties": {"stream": {"const": True}}},
        {"properties": {"stream_options": {"type": "null"}}},
    ]
}
ZERO_TOKENS_NEED_ECHO = {
    "anyOf": [
        {"required": ["echo"], "properties": {"echo": {"const": True}}},
        {
            "properties": {
                "max_tokens": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]}
            }
        },
    ]
}


def with_rules(definition: dict[str, Any], *rules: dict[str, Any]) -> dict[str, Any]:
    """SamplingFields' `stream_options` only with `stream: true`; CompletionRequest's
    `max_tokens: 0` only with `echo: true` (the prompt alone)."""
    return {**definition, "allOf": [*definition.get("allOf", []), *rules]}


def declare_answers(schema: dict[str, Any]) -> None:
    """Every operation's error answers with the OpenAI body; /metrics as text."""
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            for status, description in ERRORS.items():
                if status == "413" and method != "post":
                    continue
                body = {"$ref": "#/components/schemas/ErrorResponse"}
                content = {"application/json": {"schema": body}}
                responses[status] = {"description": description, "content": content}
            if path in STREAMING:  # `stream: true` answers with Server-Sent Events
                ok = responses.setdefault("200", {"description": "OK"})
                ok.setdefault("content", {})["text/event-stream"] = {"schema": {}}  # chunks, [DONE]
            if path == "/metrics":
                text = {PROMETHEUS_TEXT: {"schema": {"type": "string"}}}
                responses["200"] = {"description": "Prometheus exposition", "content": text}


def unique_operation_ids(schema: dict[str, Any]) -> None:
    for operations in schema.get("paths", {}).values():
        for method, operation in operations.items():
            given = operation.get("operationId", "")
            if not given.endswith("_" + method):
                operation["operationId"] = f"{given.rsplit('_', 1)[0]}_{method}"


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the request models, which the handlers validate themselves (so
    that errors come out as OpenAI bodies)."""
    if app.openapi_schema is None:
        with warnings.catch_warnings():
            # A route serving two methods (GET and DELETE of a stored response) gets one
            # operation id from FastAPI; unique_operation_ids gives each its own.
            warnings.filterwarnings("ignore", message="Duplicate Operation ID")
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        unique_operation_ids(schema)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in REQUEST_MODELS:
            ref = "#/components/schemas/{model}"
            definition = model.model_json_schema(ref_template=ref)
            components.update(definition.pop("$defs", {}))
            components[model.__name__] = definition
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        components["ChatMessage"] = message_schema()
        # check_object: stream_options takes its own keys only (the model keeps extras).
        components["StreamOptions"]["additionalProperties"] = False
        components["TokenizeRequest"] = tokenize_schema(components["TokenizeRequest"])
        completion, chat = components["CompletionRequest"], components["ChatCompletionRequest"]
        components["CompletionRequest"] = with_rules(
            completion, STREAM_OPTIONS_NEED_STREAM, ZERO_TOKENS_NEED_ECHO
        )
        components["ChatCompletionRequest"] = with_rules(chat, STREAM_OPTIONS_NEED_STREAM)
        components["ErrorResponse"] = ERROR_BODY
        declare_answers(schema)
        app.openapi_schema = schema
    return app.openapi_schema


# Counts of generated tokens, by request schema: at most the longest context served.
TOKEN_COUNTS = {
    "ChatCompletionRequest": ("max_tokens", "max_completion_tokens"),
    "CompletionRequest": ("max_tokens",),
    "ResponsesRequest": ("max_output_tokens",),
}
# Token ids, by request schema: under the vocabulary.
TOKEN_IDS = {"CompletionRequest": ("prompt",), "DetokenizeRequest": ("tokens",)}
# Choices per prompt, by request schema: at most the sequences a worker takes per request.
CHOICES = {"ChatCompletionRequest": ("n",), "CompletionRequest": ("n",)}
# The gateway honours these itself (it keeps stored responses), whatever the engine.
GATEWAY_FIELDS = frozenset({"store", "previous_response_id"})


@dataclass(frozen=True)
class Served:
    """What the healthy workers serve, as far as the document can say it."""

    max_model_len: int | None = None  # the longest context; None: a card does not say
    vocab_size: int | None = None  # the largest vocabulary; None: a card does not say
    max_sequences: int | None = None  # n x prompts a worker takes in one request (the most)
    embedded_only: bool = False  # every healthy worker runs the embedded engine


def served(cards: list[dict[str, Any]], engines: set[str]) -> Served:
    """From the models' cards (their /v1/models) and the engines of the healthy workers."""

    def largest(key: str) -> int | None:
        values = [card.get(key) for card in cards]
        counts = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0]
        return max(counts) if counts and len(counts) == len(values) else None

    return Served(
        largest("max_model_len"),
        largest("vocab_size"),
        largest("max_sequences_per_request"),
        engines == {"embedded"},
    )


def cap_integers(schema: dict[str, Any], maximum: int) -> None:
    """Every integer the schema allows at most `maximum` (through anyOf and array items)."""
    if schema.get("type") == "integer":
        schema["maximum"] = min(schema.get("maximum", maximum), maximum)
    for branch in schema.get("anyOf", []):
        cap_integers(branch, maximum)
    if isinstance(schema.get("items"), dict):
        cap_integers(schema["items"], maximum)


def asking_nothing(off: tuple[Any, ...]) -> dict[str, Any]:
    """A refused field's schema: null, or one of the values that ask for nothing."""
    return {"anyOf": [{"type": "null"}, *({"const": value} for value in off)]}


def embedded_responses(components: dict[str, Any]) -> None:
    """The Responses request as the embedded engine honours it."""
    properties = components["ResponsesRequest"]["properties"]
    for name, rule in RESPONSES_REFUSED.items():
        if name not in GATEWAY_FIELDS:
            properties[name] = asking_nothing(rule.off)
    components["TextFormat"]["properties"]["type"] = {"enum": list(RESPONSES_TEXT_FORMATS)}
    components["TextConfig"]["properties"]["verbosity"] = {"type": "null"}


TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["text", "type"],
    "additionalProperties": False,
}


def embedded_messages(components: dict[str, Any]) -> None:
    """ChatMessage as the embedded worker takes it: its template's roles, text parts only,
    and null for the keys it refuses."""
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}]}
    content["anyOf"].append({"type": "null"})
    roles = []
    for role, spec in MESSAGES.items():
        if role in CHAT_ROLES:
            refused = {key: {"type": "null"} for key in MESSAGE_REFUSED if key in spec.keys}
            fixed = {"role": {"const": role}, "content": content, **refused}
            roles.append(shape_schema(spec, {**fixed, "name": {"type": "null"}}))
    components["ChatMessage"] = {"oneOf": roles}


def served_document(base: dict[str, Any], what: Served) -> dict[str, Any]:
    """The document with what the workers serve said in it (`base` is left as it was)."""
    if what == Served():
        return base
    schema = copy.deepcopy(base)
    components = schema["components"]["schemas"]
    bounds = (
        (what.max_model_len, TOKEN_COUNTS),
        (None if what.vocab_size is None else what.vocab_size - 1, TOKEN_IDS),
        (what.max_sequences, CHOICES),
    )
    for largest, fields in bounds:
        if largest is None:
            continue
        for model, names in fields.items():
            for name in names:
                cap_integers(components[model]["properties"][name], largest)
    if what.embedded_only:
        embedded_messages(components)
        embedded_responses(components)
    return schema


def served_openapi(app: FastAPI, runtime: Runtime | None) -> dict[str, Any]:
    """/openapi.json: the gateway's document with what its healthy workers serve now."""
    base = build_openapi(app)
    if runtime is None:
        return base
    fleet = runtime.fleet
    return served_document(base, served(fleet.models(), fleet.engines()))
