"""Raw proxy bytes to dataset samples: every endpoint, unary and streamed, and what is left out."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from service.capture.record import (
    RawCapture,
    Unusable,
    _every_event,
    _one_choice_stream,
    build_sample,
    sample_line,
)
from service.reports import Usage
from wire.capture import decode_shard, encode_shard

# What the proxy read from a reply before handing it over (the samples carry it, unread).
READ = {"usage": Usage(7, 2), "acceptance_length": 3.5}


def raw(
    endpoint: str, request: dict[str, Any], reply: bytes, *, stream: bool, **read: Any
) -> RawCapture:
    return RawCapture(
        endpoint=endpoint,
        request_body=json.dumps(request).encode(),
        reply=reply,
        stream=stream,
        model="tiny-coder",
        pool="dflash",
        tenant="search",
        request_id="chatcmpl-1",
        time=1795000000.0,
        **read,
    )


def sse(*events: dict[str, Any], end: bytes = b"data: [DONE]\n\n", crlf: bool = False) -> bytes:
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + end
    return body.replace(b"\n", b"\r\n") if crlf else body


def compact_sse(*events: dict[str, Any]) -> bytes:
    """A stream as vLLM and SGLang write it: JSON without spaces."""
    return b"".join(
        b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events
    )


CHAT = {
    "model": "tiny-coder",
    "messages": [{"role": "user", "content": "write a haiku"}],
    "temperature": 0.7,
    "max_tokens": 32,
    "seed": 3,
    "user": "alice@example.com",  # who asked: never captured
    "metadata": {"team": "x"},
    "stream_options": {"include_usage": True},
}
METRICS = {"speculative_decoding": {"mean_acceptance_length": 3.5, "num_spec_steps": 4}}


def test_a_unary_chat_keeps_the_conversation_sampling_and_answer_only() -> None:
    reply = {
        "id": "chatcmpl-1",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "old pond"},
                "finish_reason": "stop",
                "token_ids": [5, 6],
            }
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9},
        "metrics": METRICS,
    }
    captured = raw("/v1/chat/completions", CHAT, json.dumps(reply).encode(), stream=False, **READ)
    sample = build_sample(captured)
    assert sample.messages == CHAT["messages"] and sample.prompt is None
    assert sample.sampling == {"temperature": 0.7, "max_tokens": 32, "seed": 3}
    assert [(c.text, c.token_ids, c.finish_reason) for c in sample.completions] == [
        ("old pond", [5, 6], "stop")
    ]
    assert sample.usage == {"prompt_tokens": 7, "completion_tokens": 2}
    assert sample.acceptance_length == 3.5
    assert (sample.endpoint, sample.pool, sample.tenant) == ("chat", "dflash", "search")
    line = sample_line(captured)  # what the writer writes: the sample's own line, byte for byte
    assert line == sample.line()
    assert b"alice" not in line and b"team" not in line and b"include_usage" not in line
    assert decode_shard(encode_shard([line]), "s")[0] == sample


@pytest.mark.parametrize("crlf", [False, True])
def test_a_chat_stream_is_folded_per_choice(crlf: bool) -> None:
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"choices": [{"index": 0, "delta": {"content": "old "}, "token_ids": [5]}]},
        {"choices": [{"index": 1, "delta": {"content": "a frog"}, "token_ids": [9, 10]}]},
        {"choices": [{"index": 0, "delta": {"content": "pond"}, "token_ids": [6]}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
        {"choices": [{"index": 1, "delta": {}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}, "metrics": METRICS},
    ]
    read = {"usage": Usage(7, 5), "acceptance_length": 3.5}
    stream = sse(*events, crlf=crlf)
    sample = build_sample(raw("/v1/chat/completions", CHAT, stream, stream=True, **read))
    assert [(c.text, c.token_ids, c.finish_reason) for c in sample.completions] == [
        ("old pond", [5, 6], "length"),
        ("a frog", [9, 10], "stop"),
    ]
    assert sample.usage == {"prompt_tokens": 7, "completion_tokens": 5}
    assert sample.acceptance_length == 3.5


def test_a_completions_stream_without_token_ids() -> None:
    request = {"model": "tiny-coder", "prompt": "def fib(n):", "temperature": 0}
    events = [
        {"choices": [{"index": 0, "text": "\n    return"}]},
        {"choices": [{"index": 0, "text": " n"}]},
    ]
    sample = build_sample(raw("/v1/completions", request, sse(*events), stream=True))
    assert sample.prompt == "def fib(n):" and sample.messages is None
    assert sample.completions[0].text == "\n    return n"
    assert sample.completions[0].token_ids is None
    assert sample.temperature == 0.0


RESPONSE = {
    "id": "resp_1",
    "object": "response",
    "status": "completed",
    "output": [
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "old pond", "annotations": []}],
        }
    ],
    "usage": {"input_tokens": 7, "output_tokens": 2, "total_tokens": 9},
}
RESPONSES_REQUEST = {
    "model": "tiny-coder",
    "instructions": "be brief",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "a haiku"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
    ],
    "max_output_tokens": 16,
}


def test_responses_unary_and_stream_become_chat_messages() -> None:
    expected = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a haiku"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
    ]
    unary = build_sample(
        raw("/v1/responses", RESPONSES_REQUEST, json.dumps(RESPONSE).encode(), stream=False, **READ)
    )
    stream_bytes = sse(
        {
            "type": "response.created",
            "response": {**RESPONSE, "status": "in_progress", "output": []},
        },
        {"type": "response.output_text.delta", "delta": "old pond"},
        {"type": "response.completed", "response": RESPONSE},
        end=b"",
    )
    streamed = build_sample(
        raw("/v1/responses", RESPONSES_REQUEST, stream_bytes, stream=True, **READ)
    )
    for sample in (unary, streamed):
        assert sample.endpoint == "responses" and sample.messages == expected
        assert sample.completions[0].text == "old pond"
        assert sample.usage == {"prompt_tokens": 7, "completion_tokens": 2}
        assert sample.sampling == {"max_output_tokens": 16}


@pytest.mark.parametrize(
    "endpoint, request_body, reply",
    [
        ("/v1/chat/completions", CHAT, {"choices": [{"message": {"content": ""}}]}),
        ("/v1/completions", {"prompt": ["a", "b"]}, {"choices": [{"text": "x"}]}),
        ("/v1/chat/completions", {"messages": "hi"}, {"choices": [{"message": {"content": "x"}}]}),
        ("/v1/chat/completions", CHAT, {"choices": []}),
        ("/v1/embeddings", CHAT, {"choices": [{"text": "x"}]}),
    ],
)
def test_what_cannot_teach_a_drafter_is_unusable(
    endpoint: str, request_body: dict[str, Any], reply: dict[str, Any]
) -> None:
    with pytest.raises(Unusable):
        build_sample(raw(endpoint, request_body, json.dumps(reply).encode(), stream=False))


def test_the_fast_read_of_a_stream_equals_the_full_parse() -> None:
    """Seeded fuzz: one-choice streams whose text holds quotes, backslashes, keys as text,
    escapes and non-ASCII, with and without token ids; the fast path must give the full
    parse's answer whenever it answers, and answer for compact one-choice streams."""
    rng = random.Random(7)
    alphabet = ['"', "\\", "x", " ", "\n", "é", "😀", '"content":"', '"index":1', "\t", ": "]
    answered = 0
    for _ in range(300):
        with_ids = rng.random() < 0.5
        events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
        for n in range(rng.randint(1, 12)):
            piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 5)))
            choice: dict[str, Any] = {"index": 0, "delta": {"content": piece}}
            if with_ids:
                choice["token_ids"] = [n, n + 1]
            events.append({"choices": [choice]})
        events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        events.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9}})
        body = (
            b"".join(
                b"data: "
                + json.dumps(e, separators=(",", ":"), ensure_ascii=rng.random() < 0.5).encode()
                + b"\n\n"
                for e in events
            )
            + b"data: [DONE]\n\n"
        )
        fast = _one_choice_stream(body, b"content")
        assert _every_event(body) == (fast if fast is not None else _every_event(body))
        answered += fast is not None
    assert answered > 150  # most compact streams take the fast path


@pytest.mark.parametrize(
    "stream, key",
    [
        (sse({"choices": [{"index": 0, "delta": {"content": "a"}}]}), b"content"),  # spaced
        (compact_sse({"choices": [{"index": 0, "text": "a", "token_ids": None}]}), b"text"),
    ],
)
def test_other_shapes_take_the_full_parse(stream: bytes, key: bytes) -> None:
    assert _one_choice_stream(stream, key) is None


@pytest.mark.parametrize("asked", [{"n": 2}, {"tools": [{"type": "function"}]}])
def test_what_the_request_asked_for_decides_the_fast_read(asked: dict[str, Any]) -> None:
    """Several choices or tool calls are read in full: the request says so, with no scan of
    the stream (the fast read would fold a compact stream's two choices into one)."""
    stream = compact_sse(
        {"choices": [{"index": 0, "delta": {"content": "old "}}]},
        {"choices": [{"index": 1, "delta": {"content": "a frog"}}]},
        {"choices": [{"index": 0, "delta": {"content": "pond"}, "finish_reason": "stop"}]},
    )
    sample = build_sample(raw("/v1/chat/completions", {**CHAT, **asked}, stream, stream=True))
    assert [c.text for c in sample.completions] == ["old pond", "a frog"]
