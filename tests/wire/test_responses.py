"""The Responses request model: closed, strict, input as a string or message items, and the
conversation as chat messages."""

from __future__ import annotations

import pytest

from wire.errors import InvalidRequest
from wire.responses import ResponsesRequest, chat_messages, typed_event
from wire.schemas import validate_request


def test_input_string_and_items_become_the_same_chat_messages() -> None:
    as_string = ResponsesRequest.model_validate({"model": "m", "input": "hi", "instructions": "s"})
    as_items = ResponsesRequest.model_validate(
        {
            "model": "m",
            "instructions": "s",
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "hi"}],
                }
            ],
        }
    )
    expected = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    for req in (as_string, as_items):
        assert chat_messages(req.instructions, req.input_items()) == expected


def test_an_assistant_string_is_output_text_and_parts_join() -> None:
    req = ResponsesRequest.model_validate(
        {
            "model": "m",
            "input": [
                {"role": "assistant", "content": "a"},
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "b"},
                        {"type": "input_text", "text": "c"},
                    ],
                },
            ],
        }
    )
    assert req.input_items()[0]["content"] == [{"type": "output_text", "text": "a"}]
    assert chat_messages(None, req.input_items())[1] == {"role": "user", "content": "bc"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "input": "x", "seed": 1}, "seed"),
        ({"model": "m", "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        (
            {
                "model": "m",
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_text", "text": "x", "annotations": [1]}],
                    }
                ],
            },
            "input[0].content[0].annotations",
        ),
        ({"model": "m", "input": "x", "metadata": {"k": 1}}, "metadata.k"),
        ({"model": "m", "input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"model": "m"}, "input"),
    ],
)
def test_bad_requests_name_the_field(body: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        validate_request(ResponsesRequest, body)
    assert caught.value.param == param


def test_an_empty_input_string_is_named_empty() -> None:
    with pytest.raises(InvalidRequest) as caught:
        validate_request(ResponsesRequest, {"model": "m", "input": ""})
    assert caught.value.param == "input" and "at least 1 character" in caught.value.message


def test_a_typed_event_names_its_type() -> None:
    assert typed_event({"type": "response.created", "n": 1}) == (
        b'event: response.created\ndata: {"type":"response.created","n":1}\n\n'
    )
