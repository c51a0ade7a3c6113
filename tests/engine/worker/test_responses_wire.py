"""The response object and its stream events, read back by the OpenAI SDK's own types."""

from __future__ import annotations

import json

from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from engine.worker.responses_wire import ResponseFormatter, response_usage
from wire.responses import ResponsesRequest

REQ = ResponsesRequest.model_validate({"model": "m", "input": "hi", "max_output_tokens": 3})


def events(data: bytes) -> list[dict[str, object]]:
    out = []
    for block in data.decode().strip().split("\n\n"):
        kind, body = block.split("\n")
        event = json.loads(body.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        out.append(event)
    return out


def test_a_stream_is_the_sdk_events_in_order_and_a_length_stop_is_incomplete() -> None:
    fmt = ResponseFormatter(REQ, "resp_x", "m")
    whole = fmt.response(
        "completed", [fmt.message("abc", "completed")], response_usage(2, 3), finish="length"
    )
    assert whole["status"] == "incomplete"
    assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
    stream = events(fmt.opening() + fmt.delta("abc") + fmt.closing(whole))
    adapter: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)
    typed = [adapter.validate_python(e) for e in stream]
    assert [e.type for e in typed] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in typed] == list(range(9))
    final = Response.model_validate(whole)
    assert final.output_text == "abc" and final.usage is not None and final.usage.total_tokens == 5


def test_a_failed_stream_ends_with_response_failed() -> None:
    fmt = ResponseFormatter(REQ, "resp_x", "m")
    (event,) = events(fmt.failed("server_error", "boom"))
    adapter: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)
    failed = adapter.validate_python(event)
    assert failed.type == "response.failed"
    assert failed.response.error is not None and failed.response.error.message == "boom"
