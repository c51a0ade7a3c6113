"""Token streams and batches for target training (plain code + ChatML samples)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from engine.train.tokenizer_recipe import ENDOFTEXT, IM_END, IM_START, token_id


@dataclass(frozen=True)
class ChatIds:
    """Token ids of the fixed pieces of a ChatML exchange."""

    user_open: list[int]  # "<|im_start|>user\n"
    turn_close: list[int]  # "<|im_end|>\n<|im_start|>assistant\n"
    im_end: int

    @classmethod
    def from_tokenizer(cls, tok: Tokenizer) -> ChatIds:
        user_open = tok.encode(f"{IM_START}user\n").ids
        turn_close = tok.encode(f"{IM_END}\n{IM_START}assistant\n").ids
        return cls(user_open, turn_close, token_id(tok, IM_END))


def encode_stream(tok: Tokenizer, docs: list[str]) -> torch.Tensor:
    """All documents as one int32 stream, each preceded by <|endoftext|>."""
    sep = token_id(tok, ENDOFTEXT)
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.append(sep)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.int32)


def cached_stream(tok: Tokenizer, docs: list[str], cache: Path) -> torch.Tensor:
    if cache.exists():
        stream: torch.Tensor = torch.load(cache)
        return stream
    stream = encode_stream(tok, docs)
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save(stream, cache)
    return stream


def chat_row(
    window: torch.Tensor, chat: ChatIds, length: int, gen: torch.Generator
) -> torch.Tensor:
    """One ChatML sample of `length` tokens: user = a code prefix, assistant = its continuation.

    Teaches the chat endpoint to answer a code prefix with code. `window` must hold at
    least `length` code tokens.
    """
    overhead = len(chat.user_open) + len(chat.turn_close) + 1
    budget = length - overhead
    split = int(torch.randint(budget // 4, (3 * budget) // 4, (1,), generator=gen))
    prefix = window[:split].tolist()
    answer = window[split:budget].tolist()
    row = chat.user_open + prefix + chat.turn_close + answer + [chat.im_end]
    return torch.tensor(row[:length], dtype=torch.long)


def sample_batch(
    stream: torch.Tensor,
    batch_size: int,
    seq_len: int,
    chat: ChatIds,
    chat_fraction: float,
    gen: torch.Generator,
) -> torch.Tensor:
    """`batch_size` rows of `seq_len + 1` tokens (inputs and shifted labels)."""
    n = seq_len + 1
    starts = torch.randint(0, stream.numel() - n, (batch_size,), generator=gen)
    rows = [stream[int(s) : int(s) + n].long() for s in starts]
    is_chat = torch.rand(batch_size, generator=gen) < chat_fraction
    for i in range(batch_size):
        if bool(is_chat[i]):
            rows[i] = chat_row(rows[i], chat, n, gen)
    return torch.stack(rows)  # [batch, seq_len + 1]
