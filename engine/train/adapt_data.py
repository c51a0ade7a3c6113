"""Captured traffic (wire/capture.py) as token sequences for `dflash-train adapt`.

A sample's prompt is rebuilt as the embedded worker builds it (engine/worker/api.py): chat
and responses samples through the target's chat template (with the generation prompt
opened, `tools` and `chat_template_kwargs` as template variables, no special tokens added
again), completions samples as `encode(prompt)` with the tokenizer's special tokens. Each
completion of a sample is one sequence: its captured `token_ids` when the gateway kept
them (exactly what was served), else its text re-tokenized.

The train / held-out split is by request id, hashed with a fixed seed: every completion of
a request lands on the same side, and a dataset that grows keeps its earlier split.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from engine.tokenizer import Tokenizer
from wire.capture import CaptureDataError, CapturedSample, open_store, read_samples, shard_paths

# Fewer generated tokens than this leave no anchor with a label after it (blocks.py).
MIN_COMPLETION_TOKENS = 2


@dataclass(frozen=True)
class TrafficSequence:
    sample_id: str
    prompt: list[int]
    completion: list[int]
    temperature: float

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.completion


@dataclass(frozen=True)
class Traffic:
    sequences: list[TrafficSequence]
    warnings: list[str]  # samples skipped, each named
    num_samples: int  # samples read (usable or not)


def _content_text(content: Any) -> str:
    """A message's content as the template takes it: a string (text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return str(content)


def template_messages(sample: CapturedSample) -> list[dict[str, str]]:
    """role/content strings, `developer` read as `system` (as the worker does)."""
    out = []
    for message in sample.messages or []:
        role = "system" if message["role"] == "developer" else str(message["role"])
        out.append({"role": role, "content": _content_text(message.get("content"))})
    return out


def prompt_ids(sample: CapturedSample, tok: Tokenizer) -> list[int]:
    if sample.prompt is not None:
        return tok.encode(sample.prompt, add_special_tokens=True)  # completions' default
    kwargs = dict(sample.chat_template_kwargs or {})
    if sample.tools:
        kwargs["tools"] = sample.tools
    try:
        return tok.apply_chat_template(template_messages(sample), template_kwargs=kwargs)
    except Exception as exc:  # the template's own raise_exception, jinja errors
        raise CaptureDataError(f"sample {sample.id}: rejected by the chat template: {exc}") from exc


def sample_sequences(
    sample: CapturedSample, tok: Tokenizer, vocab_size: int
) -> list[TrafficSequence]:
    """Every completion of `sample` after its prompt; CaptureDataError naming the sample
    when a captured token id lies outside the target's vocabulary."""
    prompt = prompt_ids(sample, tok)
    out = []
    for index, completion in enumerate(sample.completions):
        if completion.token_ids is not None:
            bad = [t for t in completion.token_ids if t >= vocab_size]
            if bad:
                raise CaptureDataError(
                    f"sample {sample.id}: completions[{index}].token_ids holds {bad[0]}, outside "
                    f"the target's vocabulary of {vocab_size} (captured from another tokenizer?)"
                )
            ids = list(completion.token_ids)
        else:
            ids = tok.encode(completion.text, add_special_tokens=False)
        out.append(TrafficSequence(sample.id, prompt, ids, sample.temperature))
    return out


def build_sequences(
    samples: Iterable[CapturedSample], tok: Tokenizer, vocab_size: int, max_len: int
) -> Traffic:
    """The usable sequences of `samples`. A sequence longer than the target's context
    (`max_len`) or with too short a completion is skipped with a warning naming its sample;
    when none is left, CaptureDataError."""
    sequences: list[TrafficSequence] = []
    warnings: list[str] = []
    count = 0
    for sample in samples:
        count += 1
        for seq in sample_sequences(sample, tok, vocab_size):
            if len(seq.tokens) > max_len:
                warnings.append(
                    f"sample {seq.sample_id}: {len(seq.tokens)} tokens, longer than the "
                    f"target's context of {max_len}: skipped"
                )
            elif len(seq.completion) < MIN_COMPLETION_TOKENS:
                warnings.append(
                    f"sample {seq.sample_id}: a completion of {len(seq.completion)} tokens "
                    "has nothing to train on: skipped"
                )
            else:
                sequences.append(seq)
    if not sequences:
        why = "no samples" if count == 0 else f"none of its {count} samples is usable"
        detail = f" ({warnings[0]}{'; ...' if len(warnings) > 1 else ''})" if warnings else ""
        raise CaptureDataError(f"the dataset has {why}{detail}")
    return Traffic(sequences, warnings, count)


def load_traffic(uri: str, tok: Tokenizer, vocab_size: int, max_len: int) -> Traffic:
    """`build_sequences` over the dataset at `uri`; CaptureDataError when it has no shard."""
    fs, root = open_store(uri)
    if not shard_paths(fs, root):
        if not fs.exists(root):
            raise CaptureDataError(f"{uri}: does not exist")
        raise CaptureDataError(f"{uri}: no capture shards (capture-*.jsonl.zst or .jsonl.gz) in it")
    return build_sequences(read_samples(uri), tok, vocab_size, max_len)


def _unit(sample_id: str, seed: int) -> float:
    """A fixed pseudo-random number in [0, 1) per (seed, id)."""
    digest = hashlib.sha256(f"{seed}\0{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_ids(ids: Iterable[str], fraction: float, seed: int) -> tuple[set[str], set[str]]:
    """(train, held-out) request ids: about `fraction` held out, at least one on each side
    (the lowest hash is always held out, the highest always trained on)."""
    ranked = sorted(set(ids), key=lambda i: _unit(i, seed))
    if len(ranked) < 2:
        raise CaptureDataError(
            f"the dataset has {len(ranked)} usable request(s): at least 2 are needed "
            "(one to train on, one to measure on)"
        )
    heldout = {i for i in ranked[:-1] if _unit(i, seed) < fraction} | {ranked[0]}
    return set(ranked) - heldout, heldout
