"""The captured-traffic format: a sample survives a shard's round trip; whatever is malformed
is refused naming the shard, the line and the field; URIs are logged without credentials."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from wire.capture import (
    CaptureDataError,
    CapturedCompletion,
    CapturedSample,
    decode_shard,
    encode_shard,
    read_samples,
    redact_uri,
)

SAMPLE = CapturedSample(
    id="chatcmpl-1",
    time=1795000000.0,
    endpoint="chat",
    model="tiny-coder",
    pool="dflash",
    completions=[CapturedCompletion("def f():", [1, 2], "stop")],
    messages=[{"role": "user", "content": "a function"}],
    sampling={"temperature": 0.0},
)


def test_a_shard_round_trips_and_is_reproducible() -> None:
    data = encode_shard([SAMPLE.line(), SAMPLE.line()])
    assert data.startswith(b"\x28\xb5\x2f\xfd")  # zstd
    assert data == encode_shard([SAMPLE.line(), SAMPLE.line()])
    assert decode_shard(data, "s") == [SAMPLE, SAMPLE]
    assert SAMPLE.temperature == 0.0
    no_temperature = CapturedSample(**{**vars(SAMPLE), "sampling": {}})
    assert no_temperature.temperature == 1.0  # OpenAI's default


def test_a_dataset_folder_reads_shards_oldest_first_and_skips_other_files(tmp_path: Path) -> None:
    later = CapturedSample(**{**vars(SAMPLE), "id": "chatcmpl-2"})
    first = CapturedSample(**{**vars(SAMPLE), "id": "chatcmpl-0"})
    # A gzip shard the gateway wrote before zstd, still read, in its place by time.
    (tmp_path / "capture-20261127T000000000000Z-z.jsonl.gz").write_bytes(
        gzip.compress(first.line() + b"\n")
    )
    (tmp_path / "capture-20261127T000002000000Z-b.jsonl.zst").write_bytes(
        encode_shard([later.line()])
    )
    (tmp_path / "capture-20261127T000001000000Z-a.jsonl.zst").write_bytes(
        encode_shard([SAMPLE.line()])
    )
    (tmp_path / ".capture-x.jsonl.zst.tmp").write_bytes(b"half")
    (tmp_path / "README").write_text("not a shard")
    ids = [s.id for s in read_samples(str(tmp_path))]
    assert ids == ["chatcmpl-0", "chatcmpl-1", "chatcmpl-2"]
    assert list(read_samples(str(tmp_path / "absent"))) == []


def line(**changes: Any) -> bytes:
    record = json.loads(SAMPLE.line())
    record.update(changes)
    return json.dumps({k: v for k, v in record.items() if v != "DROP"}).encode()


@pytest.mark.parametrize(
    "raw, message",
    [
        (line(schema=2), "line 1: schema 2"),
        (line(endpoint="embeddings"), "unknown endpoint"),
        (line(prompt="x"), "either `messages` or `prompt`"),
        (line(messages=[{"content": "no role"}]), "`messages` must be objects with a `role`"),
        (line(completions=[]), "no completion"),
        (line(completions=[{"text": 3}]), "completions[0]: `text`"),
        (line(completions=[{"text": "x", "token_ids": [-1]}]), "`token_ids` must be non-negative"),
        (line(id="DROP"), "`id` is missing"),
        (line(time=True), "`time` is missing or not a int or float"),
        (b"{not json", "line 1: not JSON"),
        (b"[1, 2]", "not a JSON object"),
    ],
)
def test_a_malformed_line_names_the_shard_line_and_field(raw: bytes, message: str) -> None:
    with pytest.raises(CaptureDataError, match="shard-7") as info:
        decode_shard(encode_shard([raw]), "shard-7")
    assert message in str(info.value)


@pytest.mark.parametrize(
    "compress, kind",
    [(encode_shard, "zstd"), (lambda lines: gzip.compress(b"\n".join(lines)), "gzip")],
)
def test_a_truncated_shard_is_named(compress: Callable[[list[bytes]], bytes], kind: str) -> None:
    lines = [CapturedSample(**{**vars(SAMPLE), "id": f"chatcmpl-{n}"}).line() for n in range(50)]
    data = compress(lines)
    for cut in (len(data) // 2, len(data) - 1):
        with pytest.raises(CaptureDataError, match=f"shard-3: not a complete {kind} shard"):
            decode_shard(data[:cut], "shard-3")


def test_a_file_neither_zstd_nor_gzip_is_named() -> None:
    with pytest.raises(CaptureDataError, match="shard-4: not a zstd \\(or gzip\\) shard"):
        decode_shard(b"{}\n", "shard-4")


def test_a_shard_of_several_frames_is_read_whole() -> None:
    """A shard joined from two (`cat a.zst b.zst`), as the zstd tool reads it."""
    other = CapturedSample(**{**vars(SAMPLE), "id": "chatcmpl-2"})
    data = encode_shard([SAMPLE.line()]) + encode_shard([other.line()])
    assert decode_shard(data, "s") == [SAMPLE, other]


@pytest.mark.parametrize(
    "uri, shown",
    [
        ("s3://bucket/prefix", "s3://bucket/prefix"),
        ("s3://AKIA:secret@bucket/prefix", "s3://bucket/prefix"),
        ("/var/lib/dflash/capture", "/var/lib/dflash/capture"),
    ],
)
def test_uris_are_logged_without_credentials(uri: str, shown: str) -> None:
    assert redact_uri(uri) == shown
