"""Log-probabilities of emitted tokens, as vLLM reports them by default ("raw_logprobs"):
log_softmax of the target's own logits, before temperature, penalties or any other
processing. In a verify step position k's logits are the target's at the prefix that
token k extends, so the values are plain decoding's whether or not a draft proposed it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from engine.sequence import TokenLogprob

__all__ = ["TokenLogprob", "token_logprobs"]


def token_logprobs(logits: Tensor, token_ids: Sequence[int], num_top: int) -> list[TokenLogprob]:
    """logits [>= len(token_ids), vocab]: row i predicts token_ids[i]."""
    n = len(token_ids)
    logp = torch.log_softmax(logits[:n].float(), dim=-1)  # [n, vocab]
    ids = torch.tensor(list(token_ids), device=logp.device)[:, None]
    chosen = logp.gather(-1, ids)  # [n, 1]
    ranks = (logp >= chosen).sum(dim=-1)  # vLLM's rank: ties count against the token
    top_values, top_ids = logp.topk(num_top, dim=-1) if num_top else (logp[:, :0], ids[:, :0])
    chosen_list, rank_list = chosen[:, 0].tolist(), ranks.tolist()
    values, indices = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprob(
            token_id=token_ids[i],
            logprob=chosen_list[i],
            rank=rank_list[i],
            top=tuple(zip(indices[i], values[i], strict=True)),
        )
        for i in range(n)
    ]
