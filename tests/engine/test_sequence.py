"""Sequence stop conditions, streaming deltas and vLLM-shaped metrics, with integers."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from engine.sequence import (
    SamplingParams,
    Sequence,
    SequenceStatus,
)

EOS = 99


class LetterDetokenizer:
    """Token t is the letter chr(97 + t % 26); ids >= 90 are special (no text)."""

    def push(self, token_ids: Seq[int]) -> str:
        return "".join(chr(97 + t % 26) for t in token_ids if t < 90)


def make_seq(
    params: SamplingParams, prompt_len: int = 3, max_model_len: int = 64, spec: int | None = 3
) -> Sequence:
    return Sequence(
        "r1",
        list(range(prompt_len)),
        params,
        detokenizer=LetterDetokenizer(),
        eos_token_ids=frozenset({EOS}),
        max_model_len=max_model_len,
        arrival_time=10.0,
        num_spec_tokens=spec,
    )


def letters(word: str) -> list[int]:
    return [ord(c) - 97 for c in word]


def test_params_lists_become_tuples() -> None:
    p = SamplingParams(stop=["x"], stop_token_ids=[5])  # type: ignore[arg-type]
    assert p.stop == ("x",) and p.stop_token_ids == (5,)
    assert hash(p) == hash(SamplingParams(stop=("x",), stop_token_ids=(5,)))


def test_max_tokens_truncates_a_speculated_block() -> None:
    seq = make_seq(SamplingParams(max_tokens=5))
    assert seq.append([1, 2, 3], 1.0) == 3 and not seq.finished
    assert seq.append([4, 5, 6, 7], 2.0) == 2
    assert seq.output_token_ids == [1, 2, 3, 4, 5]
    assert seq.finish_reason == "length" and seq.status is SequenceStatus.FINISHED
    assert seq.text == "bcdef"
    assert seq.append([8], 3.0) == 0  # nothing after the end


def test_eos_stops_and_is_kept_as_a_token_not_text() -> None:
    seq = make_seq(SamplingParams(max_tokens=50))
    assert seq.append([0, EOS, 4, 5], 1.0) == 2
    assert seq.output_token_ids == [0, EOS] and seq.text == "a"
    assert seq.finish_reason == "stop"


def test_ignore_eos_runs_to_max_tokens() -> None:
    seq = make_seq(SamplingParams(max_tokens=4, ignore_eos=True))
    seq.append([EOS, EOS, 1, 2, 3], 1.0)
    assert seq.output_token_ids == [EOS, EOS, 1, 2] and seq.finish_reason == "length"


def test_stop_token_ids_stop_without_text() -> None:
    seq = make_seq(SamplingParams(max_tokens=50, stop_token_ids=(7,)))
    seq.append([1, 2, 7, 3], 1.0)
    assert seq.output_token_ids == [1, 2, 7] and seq.text == "bc"
    assert seq.finish_reason == "stop"


def test_stop_string_across_steps_truncates_text_and_tokens() -> None:
    seq = make_seq(SamplingParams(max_tokens=50, stop=("cde",)))
    seq.append(letters("abc"), 1.0)
    first = seq.take_output()
    assert first is not None and first.text_delta == "a"  # "bc" may start the stop string
    seq.append(letters("dexyz"), 2.0)
    assert seq.finish_reason == "stop"
    assert seq.text == "ab"
    assert seq.output_token_ids == letters("abcde")  # nothing past the completing token
    last = seq.take_output()
    assert last is not None and last.finished and last.text_delta == "b"


def test_earliest_stop_string_wins() -> None:
    seq = make_seq(SamplingParams(max_tokens=50, stop=("zz", "b")))
    seq.append(letters("aabzz"), 1.0)
    assert seq.text == "aa" and seq.finish_reason == "stop"


def test_context_limit_is_length() -> None:
    seq = make_seq(SamplingParams(max_tokens=100), prompt_len=5, max_model_len=8)
    seq.append([1, 2, 3, 4, 5], 1.0)
    assert seq.output_token_ids == [1, 2, 3] and seq.finish_reason == "length"


def test_position_counts_tokens_in_the_cache() -> None:
    seq = make_seq(SamplingParams(max_tokens=20), prompt_len=4)
    seq.append([1], 1.0)
    assert seq.position == 4 and seq.last_token == 1
    seq.append([2, 3, 4], 2.0)
    assert seq.position == 7 and seq.last_token == 4


def test_deltas_reassemble_and_empty_steps_say_nothing() -> None:
    seq = make_seq(SamplingParams(max_tokens=9, stop=("qq",)))
    pieces: list[str] = []
    tokens: list[int] = []
    for step, block in enumerate([[1], [2, 3], [4, 5, 6], [7, 8, 9, 10]]):
        seq.append(block, float(step))
        out = seq.take_output()
        assert out is not None
        pieces.append(out.text_delta)
        tokens += out.token_ids_delta
    assert out.finished and out.finish_reason == "length" and out.num_output_tokens == 9
    assert "".join(pieces) == seq.text == "bcdefghij"
    assert tokens == seq.output_token_ids
    assert seq.take_output() is None or seq.finished


def test_running_sequence_with_nothing_new_gives_none() -> None:
    seq = make_seq(SamplingParams(max_tokens=9))
    seq.append([1], 1.0)
    assert seq.take_output() is not None
    assert seq.take_output() is None
