"""The embedded engine's refusals, as shared with the gateway's document: each names a real
field of the request it refuses, and what asks for nothing is a valid value of that field
(the document offers exactly those values; the worker's 400s are in
tests/engine/worker/test_responses_api.py and test_app.py)."""

from __future__ import annotations

import pytest

from wire.nested import MESSAGES
from wire.refused import CHAT_ROLES, MESSAGE_REFUSED, RESPONSES_REFUSED, RESPONSES_TEXT_FORMATS
from wire.responses import ResponsesRequest, TextFormat


@pytest.mark.parametrize("name", sorted(RESPONSES_REFUSED))
def test_a_refused_responses_field_is_one_and_its_off_values_are_valid(name: str) -> None:
    assert name in ResponsesRequest.model_fields
    for value in (None, *RESPONSES_REFUSED[name].off):
        ResponsesRequest.model_validate({"model": "m", "input": "x", name: value})


def test_the_honoured_text_formats_are_formats() -> None:
    for kind in RESPONSES_TEXT_FORMATS:
        TextFormat.model_validate({"type": kind})


def test_refused_message_keys_and_roles_are_vllms() -> None:
    assert set(MESSAGES) > CHAT_ROLES
    keys = set().union(*(spec.keys for spec in MESSAGES.values())) | {"name"}
    assert set(MESSAGE_REFUSED) <= keys
