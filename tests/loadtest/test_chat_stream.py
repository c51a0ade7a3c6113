"""The locustfile's measuring logic on recorded streams: SSE parsing, records, prompt mix."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from loadtest.chat_stream import (
    DEFAULT_PROMPTS,
    RequestRecord,
    StreamError,
    StreamTracker,
    acceptance_length,
    base_url,
    chat_body,
    iter_sse_data,
    load_prompts,
    pick_prompt,
    record_from_response,
)

SPEC = {
    "mean_acceptance_length": 3.5,
    "draft_acceptance_rate": 0.36,
    "acceptance_histogram": [0, 1, 0, 1, 0, 0, 0, 0],
    "num_spec_steps": 2,
    "num_accepted_draft_tokens": 5,
    "num_draft_tokens": 14,
    "num_spec_tokens": 7,
}


def _chunk(content: str | None = None, finish: str | None = None) -> dict[str, object]:
    delta = {} if content is None else {"content": content}
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice]}


USAGE_CHUNK = {
    "id": "chatcmpl-1",
    "object": "chat.completion.chunk",
    "choices": [],
    "usage": {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20},
    "metrics": {"time_to_first_token_ms": 40.0, "speculative_decoding": SPEC},
}

# A DFlash stream as a vLLM-style server sends it: a role chunk, one chunk per verify step
# (several tokens each), the finish chunk, the usage chunk, [DONE]. Bytes, as iter_lines gives.
RECORDED = [
    line.encode()
    for event in [
        {**_chunk(), "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        _chunk("def"),
        _chunk(" add(a, b):"),
        _chunk("\n    return a + b", "stop"),
        USAGE_CHUNK,
    ]
    for line in (f"data: {json.dumps(event)}", "")
] + [b": keep-alive comment", b"", b"data: [DONE]", b""]


def test_sse_parsing_yields_every_payload_up_to_done() -> None:
    events = list(iter_sse_data(RECORDED))
    assert len(events) == 5
    assert events[-1]["usage"]["completion_tokens"] == 8


def test_multi_line_data_and_crlf_are_joined_per_the_sse_spec() -> None:
    lines = ['data: {"choices":\r\n', "data: []}\r\n", "\r\n", "data: [DONE]"]
    assert list(iter_sse_data(lines)) == [{"choices": []}]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["data: {}", ""], r"without data: \[DONE\]"),
        (["data: not json", ""], "bad SSE payload"),
        (["data: [1, 2]", ""], "not an object"),
        (['data: {"error": {"message": "engine overloaded", "code": 503}}', ""], "overloaded"),
    ],
)
def test_broken_streams_raise_stream_error(lines: list[str], message: str) -> None:
    with pytest.raises(StreamError, match=message):
        list(iter_sse_data(lines))


def test_tracker_takes_ttft_from_first_content_and_tokens_from_usage() -> None:
    tracker = StreamTracker("code", start=1000.0)
    offsets = [0.010, 0.050, 0.090, 0.130, 0.131]
    for event, offset in zip(iter_sse_data(RECORDED), offsets, strict=True):
        tracker.feed(event, offset)
    record = tracker.finish(latency_s=0.132)
    assert record.ttft_s == pytest.approx(0.050)  # the role-only chunk is not a token
    assert record.output_tokens == 8  # usage, not the 3 content chunks
    assert record.chunks == 3
    assert record.prompt_tokens == 12
    assert record.acceptance_length == 3.5
    assert record.finish_reason == "stop"
    assert record.tpot_s == pytest.approx((0.132 - 0.050) / 7)
    assert record.tokens_per_s == pytest.approx(7 / 0.082)


def test_tracker_without_usage_counts_chunks_and_plain_servers_have_no_acceptance() -> None:
    tracker = StreamTracker("prose", start=0.0)
    for i, text in enumerate(["a", "b", "c"]):
        tracker.feed(_chunk(text), 0.1 * (i + 1))
    record = tracker.finish(0.4)
    assert (record.output_tokens, record.acceptance_length) == (3, None)
    assert acceptance_length({"usage": {}, "metrics": {"time_to_first_token_ms": 1.0}}) is None


def test_tpot_is_undefined_for_one_token_or_a_single_chunk() -> None:
    base = dict(kind="x", start=0.0, prompt_tokens=1, chunks=1, acceptance_length=None,
                finish_reason="length")  # fmt: skip
    one = RequestRecord(latency_s=1.0, ttft_s=0.5, output_tokens=1, **base)  # type: ignore[arg-type]
    burst = RequestRecord(latency_s=0.5, ttft_s=0.5, output_tokens=8, **base)  # type: ignore[arg-type]
    assert one.tpot_s is None and burst.tokens_per_s is None


def test_record_round_trips_through_json() -> None:
    record = record_from_response(
        "math", 5.0, 0.7, {"choices": [{"finish_reason": "length"}], **USAGE_CHUNK}
    )
    assert record.ttft_s is None and record.output_tokens == 8
    assert RequestRecord.from_json(record.to_json()) == record


def test_chat_body_asks_for_usage_when_streaming() -> None:
    prompt = load_prompts(DEFAULT_PROMPTS)[0]
    body = chat_body(prompt, model="m", max_tokens=32, temperature=0.0, ignore_eos=True)
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"][0]["role"] == "user" and body["ignore_eos"] is True
    plain = chat_body(prompt, model="m", max_tokens=32, temperature=0.0, stream=False)
    assert "stream_options" not in plain and "ignore_eos" not in plain


def test_bundled_mix_has_the_three_classes_and_weights_steer_the_pick(tmp_path: Path) -> None:
    assert {p.kind for p in load_prompts(DEFAULT_PROMPTS)} >= {"code", "prose", "math"}
    mix = tmp_path / "mix.jsonl"
    mix.write_text(
        '# comment\n{"class": "a", "prompt": "x", "weight": 99}\n\n'
        '{"class": "b", "messages": [{"role": "user", "content": "y"}], "weight": 1}\n'
    )
    prompts = load_prompts(mix)
    rng = random.Random(0)
    picks = [pick_prompt(prompts, rng).kind for _ in range(200)]
    assert picks.count("a") > 150 and "b" in picks
    assert prompts[1].as_messages() == [{"role": "user", "content": "y"}]


@pytest.mark.parametrize(
    "line", ['{"prompt": "x"}', '{"class": "a"}', '{"class": "a", "prompt": "x", "weight": 0}']
)
def test_bad_prompt_lines_name_file_and_line(tmp_path: Path, line: str) -> None:
    mix = tmp_path / "bad.jsonl"
    mix.write_text('{"class": "ok", "prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_prompts(mix)


def test_base_url_accepts_host_or_v1_url() -> None:
    assert base_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000/v1"
    assert base_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000/v1"
