"""The SSE tap: events pass through byte for byte, split anywhere, usage chunk stripped."""

from __future__ import annotations

import json

import pytest

from service.sse import SseTap

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = (
    b'data: {"choices":[{"index":0,"delta":{"content":"x"}}],"usage":{"completion_tokens":1}}\n\n'
)
USAGE = (
    b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}, '
    b'"metrics": {"speculative_decoding": {"num_spec_steps": 1}}}\n\n'
)
DONE = b"data: [DONE]\n\n"
STREAM = ROLE + TOKEN + TOKEN + USAGE + DONE


def feed_in_pieces(tap: SseTap, data: bytes, size: int) -> bytes:
    return b"".join(tap.feed(data[i : i + size]) for i in range(0, len(data), size))


def test_passes_every_byte_when_the_client_asked_for_usage() -> None:
    for size in (1, 7, 64, len(STREAM)):
        tap = SseTap(strip_usage_chunk=False)
        assert feed_in_pieces(tap, STREAM, size) == STREAM
        assert tap.done and tap.first_token_at is not None
        assert tap.final is not None and tap.final["usage"]["completion_tokens"] == 2


def test_strips_only_the_usage_chunk_and_still_reads_it() -> None:
    tap = SseTap(strip_usage_chunk=True)
    assert feed_in_pieces(tap, STREAM, 5) == ROLE + TOKEN + TOKEN + DONE
    assert tap.final is not None and tap.final["metrics"]["speculative_decoding"]


def test_first_token_skips_the_role_chunk_and_crlf_is_read() -> None:
    tap = SseTap(strip_usage_chunk=False)
    tap.feed(ROLE.replace(b"\n", b"\r\n"))
    assert tap.first_token_at is None
    tap.feed(TOKEN)
    assert tap.first_token_at is not None


def test_error_events_and_garbage() -> None:
    tap = SseTap(strip_usage_chunk=True)
    error = b"data: " + json.dumps({"error": {"message": "boom"}}).encode() + b"\n\n"
    out = tap.feed(b": comment\n\ndata: {not json\n\n" + error)
    assert out.endswith(error) and tap.errored and not tap.done
    assert tap.final is None


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_reasoning_counts_as_the_first_token(field: str) -> None:
    """vLLM 0.32 streams reasoning as delta.reasoning (older: reasoning_content)."""
    tap = SseTap(strip_usage_chunk=False)
    tap.feed(ROLE)
    chunk = {"choices": [{"index": 0, "delta": {field: "Let me think"}}]}
    tap.feed(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    assert tap.first_token_at is not None


def test_finish_reasons_of_a_traced_stream() -> None:
    """Each choice's last finish_reason, compact or spaced, beside others still null."""
    events = (
        b'data: {"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}\n\n'
        b'data: {"choices":[{"index":0,"finish_reason":null},'
        b'{"index":1,"finish_reason":"length"}]}\n\n'
        b'data: {"choices": [{"index": 0, "finish_reason": "stop"}]}\n\n'
        b'data: {"choices": [{"index": 0, "finish_reason": null}]}\n\n' + DONE
    )
    tap = SseTap(strip_usage_chunk=False, finish_reasons=True)
    assert feed_in_pieces(tap, events, 13) == events
    assert tap.finish_reasons == ["length", "stop"]
    assert SseTap(strip_usage_chunk=False).finish_reasons is None  # untraced: not collected
