"""The SSE tap: events pass through byte for byte, split anywhere, usage chunk stripped."""

from __future__ import annotations

import itertools
import json
import random

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


LINE_ENDS = {"crlf": b"\r\n", "cr": b"\r", "lf": b"\n"}


def with_line_ends(stream: bytes, end: bytes) -> bytes:
    return stream.replace(b"\n", end)


def split_at(data: bytes, *cuts: int) -> list[bytes]:
    edges = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


@pytest.mark.parametrize("end", LINE_ENDS.values(), ids=list(LINE_ENDS))
@pytest.mark.parametrize("strip", [False, True], ids=["usage-asked", "usage-stripped"])
def test_every_event_is_read_once_wherever_the_reads_split_it(end: bytes, strip: bool) -> None:
    """SSE allows CRLF, CR and LF line ends. Cut the stream in two at every byte offset (a
    CRLF, or a whole blank line, split across reads): the client gets the worker's bytes
    unchanged (less the usage chunk it did not ask for), each event is counted once and the
    usage, speculation and end of stream are read."""
    stream = with_line_ends(STREAM, end)
    expected = with_line_ends(ROLE + TOKEN + TOKEN + DONE, end) if strip else stream
    for cut in range(len(stream) + 1):
        tap = SseTap(strip_usage_chunk=strip)
        out = b"".join(tap.feed(piece) for piece in split_at(stream, cut))
        assert out == expected, f"cut at {cut}"
        assert tap.events == 5 and tap.done, f"cut at {cut}"
        assert tap.final is not None and tap.final["usage"]["completion_tokens"] == 2
        assert tap.final["metrics"]["speculative_decoding"]["num_spec_steps"] == 1


@pytest.mark.parametrize("end", [b"\r\n", b"\r"], ids=["crlf", "cr"])
def test_a_usage_chunk_ending_a_read_on_a_cr_is_stripped_whole(end: bytes) -> None:
    """Three reads: the usage chunk's last CR ends one read, its LF (if any) starts the next:
    that byte belongs to the stripped chunk and must not reach the client."""
    stream = with_line_ends(STREAM, end)
    usage_end = stream.index(with_line_ends(DONE, end))
    for cut in range(1, len(stream)):
        for second in (usage_end - 1, usage_end, usage_end + 1):
            if not cut < second < len(stream):
                continue
            tap = SseTap(strip_usage_chunk=True)
            out = b"".join(tap.feed(p) for p in split_at(stream, cut, second))
            assert out == with_line_ends(ROLE + TOKEN + TOKEN + DONE, end), (cut, second)
            assert tap.events == 5


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
    tap = SseTap(strip_usage_chunk=False, collect_finish_reasons=True)
    assert feed_in_pieces(tap, events, 13) == events
    assert tap.finish_reasons == ["length", "stop"]
    assert SseTap(strip_usage_chunk=False).finish_reasons is None  # untraced: not collected


@pytest.mark.parametrize("end", LINE_ENDS.values(), ids=list(LINE_ENDS))
def test_blank_lines_before_an_event_do_not_hide_it(end: bytes) -> None:
    """An extra empty line before `data: [DONE]` is legal SSE: the stream still ends."""
    stream = with_line_ends(ROLE + USAGE + b"\n" + DONE, end)
    tap = SseTap(strip_usage_chunk=False)
    assert tap.feed(stream) == stream
    assert tap.done and tap.final is not None


def test_a_crlf_responses_stream_is_rewritten_and_ends() -> None:
    """The Responses path over CRLF: events carrying the response object are rewritten, the
    others pass unchanged, and the terminal event ends the stream, wherever the reads split."""
    created = (
        b'event: response.created\ndata: {"type":"response.created","response":{"id":"r"}}\n\n'
    )
    delta = (
        b"event: response.output_text.delta\n"
        b'data: {"type":"response.output_text.delta","delta":"x"}\n\n'
    )
    done = (
        b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"r"}}\n\n'
    )
    stream = (created + delta + done).replace(b"\n", b"\r\n")

    def rewrite(event: bytes) -> bytes:
        return event.replace(b'"id":"r"', b'"id":"r","store":true')

    expected = stream.replace(b'"id":"r"', b'"id":"r","store":true')
    for cut in range(len(stream) + 1):
        tap = SseTap(strip_usage_chunk=False, rewrite=rewrite)
        out = b"".join(tap.feed(piece) for piece in split_at(stream, cut))
        assert out == expected, f"cut at {cut}"
        assert tap.done and tap.events == 3 and tap.first_token_at is not None


def test_random_line_ends_and_reads_fuzz() -> None:
    """A bounded fuzz (seeded): every line end chosen at random among CRLF, CR and LF, the
    stream cut into up to six reads at random, with and without the usage chunk stripped:
    the bytes pass as sent (less the stripped chunk), each event is counted once, and the
    usage and the end are read."""
    rng = random.Random(2026)
    events = [ROLE, TOKEN, TOKEN, USAGE, DONE]
    for _ in range(2000):
        built = []
        for event in events:
            lines = event[:-2].split(b"\n")
            ends = [rng.choice(list(LINE_ENDS.values())) for _ in range(len(lines) + 1)]
            if ends[-2] == b"\r" and ends[-1] == b"\n":  # CR then LF is one CRLF, not two
                ends[-1] = b"\r"
            built.append(
                b"".join(line + end for line, end in zip(lines, ends, strict=False)) + ends[-1]
            )
        stream = b"".join(built)
        strip = rng.random() < 0.5
        expected = b"".join(e for i, e in enumerate(built) if i != 3) if strip else stream
        cuts = sorted(rng.sample(range(1, len(stream)), rng.randint(0, 5)))
        tap = SseTap(strip_usage_chunk=strip)
        out = b"".join(tap.feed(piece) for piece in split_at(stream, *cuts))
        assert out == expected, (stream, cuts)
        assert tap.events == 5 and tap.done
        assert tap.final is not None and tap.final["usage"]["completion_tokens"] == 2
