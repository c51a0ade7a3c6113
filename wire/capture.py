"""The captured-traffic dataset: one format, written by the gateway (service/capture/) and read
by `dflash-train adapt` (engine/train/adapt.py).

A dataset is a folder (any fsspec URI: a local path, `s3://bucket/prefix`, `gs://...`) of
shards. A shard is zstd-compressed JSON Lines, one captured request per line, named
`capture-<UTC time>-<random>.jsonl.zst` (gzip-compressed `.jsonl.gz` shards, which the gateway
wrote before, are still read); a shard is complete or absent (written under a
temporary name and renamed on a local disk, one PUT on an object store). A line:

    {"schema": 1, "id": "chatcmpl-...", "time": 1795000000.0,
     "endpoint": "chat" | "completions" | "responses",
     "model": "tiny-coder", "pool": "dflash", "tenant": "search" | null,
     "messages": [{"role": "user", "content": "..."}] | null,   # chat and responses
     "prompt": "..." | null,                                     # completions
     "tools": [...] | null, "chat_template_kwargs": {...} | null,
     "sampling": {"temperature": 0.0, "max_tokens": 64, ...},
     "completions": [{"text": "...", "token_ids": [..] | null, "finish_reason": "stop"}],
     "usage": {"prompt_tokens": 12, "completion_tokens": 64} | null,
     "acceptance_length": 4.2 | null}

Nothing secret is in it: no key, no header, no tenant secret; of the request body only the
conversation and the sampling fields below are kept.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import zstandard

SCHEMA_VERSION = 1
SHARD_PREFIX, SHARD_SUFFIX = "capture-", ".jsonl.zst"
# Shards are told apart by their first bytes; both kinds are read, only zstd is written.
GZIP_SUFFIX, GZIP_MAGIC, ZSTD_MAGIC = ".jsonl.gz", b"\x1f\x8b", b"\x28\xb5\x2f\xfd"
ENDPOINTS = ("chat", "completions", "responses")
# The request fields kept as `sampling`: what decides the completion, nothing about who sent it.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "seed",
    "stop",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


class CaptureDataError(ValueError):
    """A shard or sample that cannot be used; the message names the file and the line."""


# Not frozen, either: the gateway's capture writer makes one of each per captured request,
# and a frozen __init__ (each field through object.__setattr__) cost it 1.6 µs a sample
# (measured), about a tenth of its work.
@dataclass
class CapturedCompletion:
    text: str
    token_ids: list[int] | None = None
    finish_reason: str | None = None


@dataclass
class CapturedSample:
    id: str
    time: float
    endpoint: str
    model: str
    pool: str
    completions: list[CapturedCompletion]
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    tenant: str | None = None
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    usage: dict[str, int] | None = None
    acceptance_length: float | None = None

    @property
    def temperature(self) -> float:
        """The request's temperature; OpenAI's default (1.0) when it named none."""
        value = self.sampling.get("temperature")
        return float(value) if isinstance(value, int | float) else 1.0

    def line(self) -> bytes:
        # Field by field: dataclasses.asdict deep-copies every message (5x the time).
        record = {"schema": SCHEMA_VERSION, **vars(self)}
        record["completions"] = [vars(completion) for completion in self.completions]
        return dump_json(record)


# The gateway's capture writer reads and writes JSON on the gateway's own CPU, thousands of
# times a second: orjson does it in well under half the stdlib's time. What orjson refuses and
# Python's json allows (a lone surrogate escape, NaN, a number past a double) takes the
# stdlib's path; an integer past 64 bits reads as a float (the gateway's validation has
# already bounded the fields a sample keeps).
def load_json(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def dump_json(value: Any) -> bytes:
    """Compact JSON (no spaces), as `json.dumps(separators=(",", ":"))` writes it."""
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return json.dumps(value, separators=(",", ":")).encode()


def _require(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise CaptureDataError(f"{where}: `{key}` is missing or not a {_kind_name(kind)}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _optional(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    return None if obj.get(key) is None else _require(obj, key, kind, where)


def parse_sample(obj: object, where: str) -> CapturedSample:
    """One line's JSON as a sample; CaptureDataError naming `where` and the field otherwise."""
    if not isinstance(obj, dict):
        raise CaptureDataError(f"{where}: not a JSON object")
    if obj.get("schema") != SCHEMA_VERSION:
        raise CaptureDataError(
            f"{where}: schema {obj.get('schema')!r}; this version reads {SCHEMA_VERSION}"
        )
    endpoint = _require(obj, "endpoint", str, where)
    if endpoint not in ENDPOINTS:
        raise CaptureDataError(f"{where}: unknown endpoint {endpoint!r}")
    messages = _optional(obj, "messages", list, where)
    prompt = _optional(obj, "prompt", str, where)
    if (messages is None) == (prompt is None):
        raise CaptureDataError(f"{where}: a sample has either `messages` or `prompt`")
    if messages is not None and not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
    ):
        raise CaptureDataError(f"{where}: `messages` must be objects with a `role`")
    completions = []
    for index, raw in enumerate(_require(obj, "completions", list, where)):
        spot = f"{where}: completions[{index}]"
        if not isinstance(raw, dict):
            raise CaptureDataError(f"{spot}: not an object")
        ids = _optional(raw, "token_ids", list, spot)
        if ids is not None and not all(isinstance(i, int) and i >= 0 for i in ids):
            raise CaptureDataError(f"{spot}: `token_ids` must be non-negative integers")
        completions.append(
            CapturedCompletion(
                _require(raw, "text", str, spot), ids, _optional(raw, "finish_reason", str, spot)
            )
        )
    if not completions:
        raise CaptureDataError(f"{where}: no completion")
    acceptance = _optional(obj, "acceptance_length", (int, float), where)
    return CapturedSample(
        id=_require(obj, "id", str, where),
        time=float(_require(obj, "time", (int, float), where)),
        endpoint=endpoint,
        model=_require(obj, "model", str, where),
        pool=_require(obj, "pool", str, where),
        completions=completions,
        messages=messages,
        prompt=prompt,
        tenant=_optional(obj, "tenant", str, where),
        tools=_optional(obj, "tools", list, where),
        chat_template_kwargs=_optional(obj, "chat_template_kwargs", dict, where),
        sampling=_optional(obj, "sampling", dict, where) or {},
        usage=_optional(obj, "usage", dict, where),
        acceptance_length=None if acceptance is None else float(acceptance),
    )


# zstd level 1: measured on 500 chat samples of distinct prose (999 bytes of JSON each, one
# shard), it stores 220 bytes a sample (4.5x) for 1.8-1.9 µs of CPU, where gzip level 1,
# written before, stored 241 bytes (4.1x) for 5.7-6.1 µs; zstd level -5 320 bytes for 1.5 µs,
# lz4 308 bytes for 1.3 µs. In the gateway, on answers of 1,000 characters, the writer's CPU
# fell from 40-43 to 33-35 µs a sample (loadtest/RESULTS.md, "Capture on real-sized
# answers"): the writer's CPU is the gateway's (docs/capture.md). The frame carries its
# content size and a checksum.
COMPRESS_LEVEL = 1


def encode_shard(lines: list[bytes]) -> bytes:
    """A shard's bytes: the lines, newline-terminated, compressed (the same samples give the
    same bytes)."""
    return compress_shard(b"".join(line + b"\n" for line in lines))


def compress_shard(body: bytes | bytearray) -> bytes:
    """A shard's bytes from its newline-terminated lines, already joined."""
    compressor = zstandard.ZstdCompressor(level=COMPRESS_LEVEL, write_checksum=True)
    return compressor.compress(body)  # a bytearray as it is: no copy of the shard


def decode_shard(data: bytes, name: str) -> list[CapturedSample]:
    """Every sample of one shard; CaptureDataError naming the shard (and line) when it is
    truncated, neither zstd nor gzip, or holds a malformed line."""
    text = _decompress(data, name)
    samples = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{name}: line {number}"
        try:
            obj = json.loads(raw)
        except ValueError:
            raise CaptureDataError(f"{where}: not JSON") from None
        samples.append(parse_sample(obj, where))
    return samples


def _decompress(data: bytes, name: str) -> bytes:
    if data.startswith(GZIP_MAGIC):
        try:
            return gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise CaptureDataError(f"{name}: not a complete gzip shard ({exc})") from None
    if not data.startswith(ZSTD_MAGIC):
        raise CaptureDataError(f"{name}: not a zstd (or gzip) shard")
    pieces, decompressor = [], zstandard.ZstdDecompressor()
    try:
        while data:  # frame by frame: a shard joined from several is read whole, as zstd does
            frame = decompressor.decompressobj()
            pieces.append(frame.decompress(data))
            if not frame.eof:
                raise zstandard.ZstdError("the last frame is cut short")
            data = frame.unused_data
    except zstandard.ZstdError as exc:
        raise CaptureDataError(f"{name}: not a complete zstd shard ({exc})") from None
    return b"".join(pieces)


def is_shard(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return base.startswith(SHARD_PREFIX) and base.endswith((SHARD_SUFFIX, GZIP_SUFFIX))


def redact_uri(uri: str) -> str:
    """The URI for a log line: credentials written into it (user:secret@) left out."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return uri
    authority, slash, path = rest.partition("/")
    host = authority.rpartition("@")[2]
    return f"{scheme}://{host}{slash}{path}"


# The stores a dataset lives in (docs/capture.md): a folder (a path, or file://), S3, GCS.
DATASET_SCHEMES = frozenset({"file", "s3", "gs", "gcs"})


def dataset_scheme_problem(uri: str) -> str | None:
    """Why `uri` names no store a dataset can live in, or None: fsspec opens many more
    (ftp://, http://) that were never meant to hold captured prompts."""
    scheme, sep, _ = uri.partition("://")
    if not sep or scheme.lower() in DATASET_SCHEMES:
        return None
    return f"unsupported scheme {scheme}://: a folder, s3:// or gs://"


def open_store(uri: str) -> tuple[Any, str]:
    """The fsspec filesystem and root path of a dataset URI (s3:// needs s3fs, gs:// gcsfs:
    the `capture-s3` and `capture-gcs` extras)."""
    from fsspec.core import url_to_fs

    try:
        # Its own instance: fsspec caches one per URI and options, which would keep the
        # endpoint and credentials of whoever opened the store first in this process.
        fs, root = url_to_fs(uri, skip_instance_cache=True)
    except (ImportError, ValueError) as exc:
        raise CaptureDataError(f"{uri}: cannot open the dataset: {exc}") from None
    return fs, root.rstrip("/")


def shard_paths(fs: Any, root: str) -> list[str]:
    """The dataset's shards, oldest first (names begin with their UTC time)."""
    try:
        names = fs.ls(root, detail=False)
    except FileNotFoundError:
        return []
    return sorted((str(name) for name in names if is_shard(str(name))), key=_base)


def _base(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def read_samples(uri: str) -> Iterator[CapturedSample]:
    """Every sample of a dataset, shard by shard, oldest first."""
    fs, root = open_store(uri)
    for path in shard_paths(fs, root):
        yield from decode_shard(fs.cat_file(path), path)
