"""The gateway's side of the Responses API: `store` and `previous_response_id`.

Workers keep nothing. The gateway expands `previous_response_id` into the stored
conversation, sends the worker the whole conversation with `store: false`, and, when the
client asked to store (OpenAI's default), keeps the answer (service/tenancy/response_store.py)
before the client has it, so the next request can continue it on any gateway process.
The answer the client gets says what the client asked (`store`, `previous_response_id`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.tenancy.redis_client import RedisUnavailable
from service.tenancy.response_store import Record, ResponseStore
from wire.errors import InvalidRequest, NotFound, Unavailable
from wire.responses import (
    ResponsesRequest,
    failed_event,
    joined_text,
    message_id,
    message_item,
    typed_event,
)

log = logging.getLogger("dflash.gateway.responses")
# The statuses of a response worth storing for `previous_response_id`: it ended with an
# answer (a failed one has none to continue from).
STORABLE = ("completed", "incomplete")


def output_items(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A response's output messages as input items of the conversation that continues it."""
    items = []
    for item in response.get("output") or []:
        if isinstance(item, dict) and item.get("type") == "message":
            text = joined_text(item.get("content"), "output_text")
            items.append(message_item("assistant", "output_text", text))
    return items


def with_ids(response_id: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as OpenAI lists them: each with an id and a status."""
    return [
        {"id": message_id(response_id, i), "status": "completed", **item}
        for i, item in enumerate(items)
    ]


# OpenAI's query for a response's input items (GET /v1/responses/{id}/input_items).
ITEMS_QUERY = ("after", "limit", "order", "include", "include[]")  # an SDK's list: include[]
DEFAULT_ITEMS_LIMIT, MOST_ITEMS = 20, 100


def items_page(items: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """A page of a stored response's input items by OpenAI's query: `order` (desc by
    default), `limit` (1-100, default 20), `after` (an item id: the page starts after it).
    `include` asks for extra output fields no stored item has: refused unless empty. Any
    other parameter, or a bad value, is a 400 naming it."""
    for name in query:
        if name not in ITEMS_QUERY:
            raise InvalidRequest(f"{name}: not a query parameter of input_items", param=name)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order: must be asc or desc", param="order")
    text = query.get("limit", str(DEFAULT_ITEMS_LIMIT))
    if not (text.isdigit() and 1 <= int(text) <= MOST_ITEMS):
        raise InvalidRequest(f"limit: must be an integer from 1 to {MOST_ITEMS}", param="limit")
    if query.get("include") or query.get("include[]"):
        raise InvalidRequest("include: stored input items carry no extra fields", param="include")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise InvalidRequest(f"after: no input item `{after}` in this response", param="after")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[: int(text)]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > len(page),
    }


async def load(store: ResponseStore, tenant: str, response_id: str, param: str) -> Record:
    try:
        record = await store.get(tenant, response_id)
    except RedisUnavailable:
        raise Unavailable("The response store is unavailable; retry.", code="store") from None
    if record is None:
        raise NotFound(f"Response with id '{response_id}' not found.", param=param)
    return record


@dataclass
class StoreHook:
    """One request's part in the store: the conversation it sends, what it keeps."""

    store: ResponseStore
    tenant: str
    keep_it: bool  # the client's `store` (OpenAI's default: true)
    previous: str | None
    input_items: list[dict[str, Any]]
    conversation: list[dict[str, Any]]  # prior conversation + this input
    opened: dict[str, Any] | None = None  # the stream's response.created object
    kept: bool = False

    def patch(self, response: dict[str, Any]) -> dict[str, Any]:
        response["store"] = self.keep_it
        response["previous_response_id"] = self.previous
        return response

    def patch_event(self, event: bytes) -> bytes:
        """A stream event carrying the response object, with the client's store fields."""
        head, sep, data = event.partition(b"data:")
        try:
            obj = json.loads(data)
        except ValueError:
            return event
        response = obj.get("response") if isinstance(obj, dict) else None
        if not isinstance(response, dict):
            return event
        self.patch(response)
        if obj.get("type") == "response.created":
            self.opened = response
        return head + sep + b" " + json.dumps(obj, separators=(",", ":")).encode()

    async def keep(self, response: object) -> None:
        """Store a finished response (before the client sees its end)."""
        if self.kept or not self.keep_it or not isinstance(response, dict):
            return
        if response.get("status") not in STORABLE or not isinstance(response.get("id"), str):
            return
        self.kept = True
        record = {
            "response": self.patch(dict(response)),
            "input_items": with_ids(response["id"], self.input_items),
            "conversation": self.conversation + output_items(response),
        }
        try:
            await self.store.put(self.tenant, response["id"], record)
        except RedisUnavailable:
            log.warning("response %s was not stored: the store is unavailable", response["id"])

    def failed(self, code: str, message: str, sequence: int) -> bytes:
        """The stream's last event when it breaks after the first byte: response.failed (the
        opened response, failed), else OpenAI's `error` event."""
        if self.opened is not None:
            return failed_event(self.opened, "server_error", message, sequence)
        event = {"type": "error", "code": code, "message": message, "param": None}
        return typed_event({**event, "sequence_number": sequence})


async def prepare(
    store: ResponseStore, tenant: str, req: ResponsesRequest, payload: dict[str, Any], limit: int
) -> tuple[bytes, StoreHook]:
    """The body the worker gets (the whole conversation, nothing stored) and the hook."""
    prior: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        record = await load(store, tenant, req.previous_response_id, "previous_response_id")
        prior = record["conversation"]
    items = req.input_items()
    conversation = prior + items
    keep_it = req.store is not False
    body = {k: v for k, v in payload.items() if k not in ("previous_response_id", "store")}
    body["input"], body["store"] = conversation, False
    raw = json.dumps(body, separators=(",", ":")).encode()
    if keep_it and len(raw) > limit:
        raise InvalidRequest(
            f"store: the conversation is {len(raw)} bytes, over the {limit}-byte bound on a "
            "stored response (send store: false, or start a shorter conversation)",
            param="store",
        )
    hook = StoreHook(store, tenant, keep_it, req.previous_response_id, items, conversation)
    return raw, hook


def affinity_text(conversation: list[dict[str, Any]], limit: int) -> str:
    parts: list[str] = []
    for item in conversation:
        parts.append(item["role"])
        parts.extend(part["text"] for part in item["content"])
        if sum(len(part) for part in parts) >= limit:
            break
    return "\x1f".join(parts)[:limit]
