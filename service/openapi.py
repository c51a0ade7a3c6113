"""The gateway's OpenAPI document, made to say what the gateway does: the request models'
schemas with the nested rules the validation enforces (wire/nested.py's shapes become the
declared message schemas), the error statuses every operation can answer with their OpenAI
error body, and /metrics as Prometheus text. FastAPI's 422 is never sent (a bad request is a
400 here), so it is not declared."""

from __future__ import annotations

import warnings
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST

from wire.nested import MESSAGES, PARTS, UNTYPED_PART, Shape
from wire.responses import ResponsesRequest
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
        components["TokenizeRequest"] = tokenize_schema(components["TokenizeRequest"])
        components["ErrorResponse"] = ERROR_BODY
        declare_answers(schema)
        app.openapi_schema = schema
    return app.openapi_schema
