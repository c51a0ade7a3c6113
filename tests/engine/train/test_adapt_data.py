"""Captured samples as token sequences: prompts rebuilt as the worker builds them, every
completion used, bad samples named, and a stable split by request id."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.tokenizer import Tokenizer
from engine.train.adapt_data import build_sequences, load_traffic, sample_sequences, split_ids
from wire.capture import CaptureDataError, CapturedCompletion, CapturedSample, encode_shard

TARGET = Path(__file__).resolve().parents[3] / "engine" / "assets" / "tiny-coder" / "target"
VOCAB = 4096


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(TARGET)


def sample(sample_id: str = "chatcmpl-1", **fields: object) -> CapturedSample:
    base: dict[str, object] = {
        "id": sample_id,
        "time": 1.0,
        "endpoint": "chat",
        "model": "tiny-coder",
        "pool": "dflash",
        "completions": [CapturedCompletion("the sea is blue and the sky is grey")],
        "messages": [{"role": "user", "content": "Write about the sea."}],
        "sampling": {"temperature": 0.0},
    }
    base.update(fields)
    return CapturedSample(**base)  # type: ignore[arg-type]


def test_chat_prompt_is_the_worker_template_and_text_is_retokenized(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "Write about "}, {"type": "text", "text": "the sea."}]
    s = sample(
        messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": parts}]
    )
    (seq,) = sample_sequences(s, tok, VOCAB)
    expected = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Write about the sea."},
    ]
    assert seq.prompt == tok.apply_chat_template(expected)
    assert seq.completion == tok.encode(
        "the sea is blue and the sky is grey", add_special_tokens=False
    )
    assert seq.temperature == 0.0


def test_completions_prompt_and_captured_token_ids_and_every_completion(tok: Tokenizer) -> None:
    s = sample(
        endpoint="completions",
        messages=None,
        prompt="Dear diary,",
        completions=[CapturedCompletion("x", [7, 8, 9]), CapturedCompletion("y z w", None)],
        sampling={},
    )
    first, second = sample_sequences(s, tok, VOCAB)
    assert first.prompt == second.prompt == tok.encode("Dear diary,")
    assert first.completion == [7, 8, 9]  # as served, not re-tokenized
    assert second.completion == tok.encode("y z w", add_special_tokens=False)
    assert first.temperature == 1.0  # OpenAI's default when the request named none


def test_token_ids_outside_the_vocabulary_name_the_sample(tok: Tokenizer) -> None:
    s = sample("req-bad", completions=[CapturedCompletion("x", [5, VOCAB + 3])])
    with pytest.raises(CaptureDataError, match=r"sample req-bad: .*4099.*vocabulary"):
        sample_sequences(s, tok, VOCAB)


def test_too_long_samples_are_skipped_by_name_and_all_too_long_is_an_error(
    tok: Tokenizer,
) -> None:
    long = sample("req-long", messages=[{"role": "user", "content": "word " * 300}])
    traffic = build_sequences([long, sample("req-ok")], tok, VOCAB, max_len=100)
    assert [s.sample_id for s in traffic.sequences] == ["req-ok"]
    assert len(traffic.warnings) == 1 and "req-long" in traffic.warnings[0]
    with pytest.raises(CaptureDataError, match=r"req-long.*longer than the target.s context"):
        build_sequences([long], tok, VOCAB, max_len=100)


def test_empty_datasets_are_errors(tok: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(CaptureDataError, match="no capture shards"):
        load_traffic(str(tmp_path), tok, VOCAB, 2048)
    (tmp_path / "capture-20260101T000000Z-a.jsonl.zst").write_bytes(encode_shard([]))
    with pytest.raises(CaptureDataError, match="no samples"):
        load_traffic(str(tmp_path), tok, VOCAB, 2048)


def test_split_by_request_id_is_stable_and_never_empty() -> None:
    ids = [f"req-{i}" for i in range(100)]
    train, held = split_ids(ids, 0.15, seed=0)
    assert train | held == set(ids) and not train & held
    assert 5 <= len(held) <= 30
    assert split_ids(reversed(ids), 0.15, seed=0) == (train, held)  # order does not matter
    # A grown dataset keeps the earlier split for the ids it had.
    train2, held2 = split_ids([*ids, *(f"new-{i}" for i in range(50))], 0.15, seed=0)
    assert held <= held2 and train <= train2
    assert split_ids(["a", "b"], 0.0, seed=0)[1] and split_ids(["a", "b"], 1.0, seed=0)[0]
    with pytest.raises(CaptureDataError, match="at least 2"):
        split_ids(["only"], 0.15, seed=0)
