"""Response bodies: vLLM's per-request `metrics` object built from the engine's request
state (interval definitions, speculation arithmetic, summary vs detailed), usage, chunks."""

from __future__ import annotations

import pytest

from engine.sequence import RequestMetrics, SamplingParams, SpecDecodeStats, TokenLogprob
from engine.worker.formatting import (
    LOGPROB_FLOOR,
    CompletionFormatter,
    metrics_object,
    speculative_object,
    usage,
)
from tests.engine.test_sequence import make_seq


def test_timing_follows_vllm_definitions() -> None:
    seq = make_seq(SamplingParams(max_tokens=5))
    seq.metrics.first_scheduled_time = 10.5
    seq.append([1], 11.0)
    seq.append([2, 3], 11.4)
    seq.append([4, 5], 12.0)
    m = metrics_object(seq.metrics, "summary", stream=True)
    assert m["queue_time_ms"] == pytest.approx(500.0)
    assert m["time_to_first_token_ms"] == pytest.approx(500.0)
    assert m["generation_time_ms"] == pytest.approx(1000.0)
    assert m["mean_itl_ms"] == pytest.approx(250.0)
    assert m["tokens_per_second"] == pytest.approx(5 / 1.5)
    assert seq.metrics.finished_time == 12.0


def test_one_token_has_no_itl_and_no_spec_key_without_drafter() -> None:
    seq = make_seq(SamplingParams(max_tokens=1), spec=None)
    seq.metrics.first_scheduled_time = 10.0
    seq.append([3], 10.2)
    m = metrics_object(seq.metrics, "summary", stream=True)
    assert m["mean_itl_ms"] is None and m["generation_time_ms"] == 0.0
    assert "speculative_decoding" not in m


def test_spec_stats_arithmetic() -> None:
    stats = SpecDecodeStats(num_spec_tokens=3)
    for drafted, accepted in [(3, 3), (3, 0), (3, 1), (3, 3), (3, 2)]:
        stats.observe(drafted, accepted)
    s = speculative_object(stats, "summary", stream=True)
    assert s["acceptance_histogram"] == [1, 1, 1, 2]
    assert sum(s["acceptance_histogram"]) == s["num_spec_steps"] == 5
    assert s["num_accepted_draft_tokens"] == 9 <= s["num_draft_tokens"] == 15
    assert s["mean_acceptance_length"] == pytest.approx(1 + 9 / 5)
    assert s["draft_acceptance_rate"] == pytest.approx(9 / 15)
    assert s["num_spec_tokens"] == 3
    assert "per_step_accepted" not in s
    d = speculative_object(stats, "detailed", stream=True)
    assert d["per_step_accepted"] == [3, 0, 1, 3, 2] and d["per_step_drafted"] == [3] * 5


def test_spec_stats_without_steps() -> None:
    s = speculative_object(SpecDecodeStats(num_spec_tokens=2), "summary", stream=True)
    assert s["acceptance_histogram"] == [0, 0, 0]
    assert s["mean_acceptance_length"] == 1.0 and s["draft_acceptance_rate"] == 0.0


def test_metrics_before_any_token_are_null() -> None:
    m = metrics_object(RequestMetrics(arrival_time=1.0), "summary", stream=True)
    assert m["time_to_first_token_ms"] is None and m["tokens_per_second"] is None
    assert m["queue_time_ms"] is None


def test_summary_sets_per_step_lists_null_in_a_whole_response_only() -> None:
    stats = SpecDecodeStats(num_spec_tokens=3)
    stats.observe(3, 2)
    whole = speculative_object(stats, "summary", stream=False)
    assert whole["per_step_accepted"] is None and whole["per_step_drafted"] is None
    assert "per_step_accepted" not in speculative_object(stats, "summary", stream=True)


def test_level_none_keeps_timings_and_drops_speculation() -> None:
    seq = make_seq(SamplingParams(max_tokens=2))
    seq.metrics.first_scheduled_time = 1.0
    seq.append([1, 2], 1.5)
    m = metrics_object(seq.metrics, "none", stream=False)
    assert "speculative_decoding" not in m and m["time_to_first_token_ms"] == 500.0


def test_usage_and_bodies() -> None:
    assert usage(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    chat = CompletionFormatter("chat", "id-1", "m", created=5)
    assert chat.role_chunk()["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    end = chat.chunk("b", "stop", "##")["choices"][0]
    assert end["delta"] == {"content": "b"} and end["stop_reason"] == "##"
    final = chat.usage_chunk(usage(1, 2), {"x": 1})
    assert final["choices"] == [] and final["metrics"] == {"x": 1}
    fmt = CompletionFormatter("completion", "id-2", "m")
    body = fmt.body([fmt.choice(0, "t", "length", None)], usage(1, 1), {})
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "t"
    assert body["choices"][0]["stop_reason"] is None and body["metrics"] == {}
    several = fmt.body([fmt.choice(i, "t", "stop", "\n") for i in (0, 1)], usage(1, 2), None)
    assert [c["index"] for c in several["choices"]] == [0, 1] and "metrics" not in several


def _request_metrics() -> RequestMetrics:
    spec = SpecDecodeStats(
        num_spec_tokens=3, per_step_accepted=[3, 0, 1], per_step_drafted=[3, 3, 3]
    )
    return RequestMetrics(
        arrival_time=1.0,
        first_scheduled_time=1.5,
        first_token_time=2.0,
        last_token_time=4.0,
        finished_time=4.0,
        num_output_tokens=5,
        spec=spec,
    )


@pytest.mark.parametrize("level", ["none", "summary", "detailed"])
def test_metrics_levels(level: str) -> None:
    m = metrics_object(_request_metrics(), level, stream=True)
    assert m["queue_time_ms"] == pytest.approx(500.0)
    assert m["time_to_first_token_ms"] == pytest.approx(500.0)
    assert m["mean_itl_ms"] == pytest.approx(500.0)
    if level == "none":
        assert "speculative_decoding" not in m
        return
    sd = m["speculative_decoding"]
    assert sd["acceptance_histogram"] == [1, 1, 0, 1]
    assert sd["mean_acceptance_length"] == pytest.approx(1 + 4 / 3)
    assert ("per_step_accepted" in sd) == (level == "detailed")


def test_plain_decoding_has_no_speculative_block() -> None:
    m = metrics_object(RequestMetrics(arrival_time=0.0), "summary", stream=True)
    assert "speculative_decoding" not in m and m["mean_itl_ms"] is None


def _name(token_id: int) -> tuple[str, bytes]:
    """A stand-in tokenizer: token 9 is half of a two-byte character."""
    return ("\ufffd", b"\xc3") if token_id == 9 else (f"t{token_id}", f"t{token_id}".encode())


ENTRIES = [
    TokenLogprob(5, -0.25, 1, ((5, -0.25), (7, -2.0))),
    TokenLogprob(9, float("-inf"), 3, ((5, -0.5), (7, -1.0))),
]


def test_chat_logprobs_are_openais_content_list() -> None:
    fmt = CompletionFormatter("chat", "id", "m", name_token=_name)
    content = fmt.choice(0, "x", "stop", None, ENTRIES)["logprobs"]["content"]
    assert content[0] == {
        "token": "t5",
        "logprob": -0.25,
        "bytes": list(b"t5"),
        "top_logprobs": [
            {"token": "t5", "logprob": -0.25, "bytes": list(b"t5")},
            {"token": "t7", "logprob": -2.0, "bytes": list(b"t7")},
        ],
    }
    # -inf is not JSON: OpenAI's and vLLM's floor; bytes are the token's own.
    assert content[1]["logprob"] == LOGPROB_FLOOR and content[1]["bytes"] == [0xC3]
    assert fmt.choice(0, "x", "stop", None, None)["logprobs"] is None


def test_completion_logprobs_carry_the_chosen_token_and_offsets_across_chunks() -> None:
    fmt = CompletionFormatter("completion", "id", "m", name_token=_name)
    first = fmt.chunk("", None, None, 0, ENTRIES[:1])["choices"][0]["logprobs"]
    assert first == {
        "text_offset": [0],
        "token_logprobs": [-0.25],
        "tokens": ["t5"],
        "top_logprobs": [{"t5": -0.25, "t7": -2.0}],
    }
    second = fmt.chunk("", None, None, 0, ENTRIES[1:])["choices"][0]["logprobs"]
    assert second["text_offset"] == [2]  # after "t5"
    # the chosen token is listed even when it is not among the top ones
    assert second["top_logprobs"] == [{"\ufffd": LOGPROB_FLOOR, "t5": -0.5, "t7": -1.0}]
    other = fmt.chunk("", None, None, 1, ENTRIES[:1])["choices"][0]["logprobs"]
    assert other["text_offset"] == [0]  # each choice has its own offsets
