"""Request state of the embedded engine: parameters, stop conditions, metrics. No torch.

A `Sequence` is one request as the scheduler sees it. The engine appends the tokens that a
step committed with `Sequence.append`, which applies every stop condition in vLLM's order
(EOS, stop token ids, stop strings, then max_tokens and the context limit) and truncates
whatever a block of speculated tokens produced past the stop. `take_output` turns what is
new since the last call into an incremental `RequestOutput`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Literal, Protocol

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks for, with vLLM's meanings; temperature 0 is greedy, top_k 0 is
    off, max_tokens None runs to the context limit."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    # Logits processors (engine/logits_processors.py).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # no stop token and no stop string before this many output tokens
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    logprobs: int | None = None  # top log-probabilities per output token (None: none)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens after the first

    def __post_init__(self) -> None:
        # Callers often hand in lists and dicts (JSON); keep the object hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, dict) else bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in pairs))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one output token, and the likeliest tokens there."""

    token_id: int
    logprob: float
    rank: int  # how many tokens are at least as likely (itself included)
    top: tuple[tuple[int, float], ...]  # (token id, logprob), the most likely first


@dataclass
class SpecDecodeStats:
    """Per-request speculation counts, one entry per verify step (vLLM's definitions)."""

    num_spec_tokens: int
    adaptive: bool = False  # k chosen per step (engine/adaptive.py)
    num_plain_steps: int = 0  # adaptive steps that verified no draft (not in the lists)
    per_step_accepted: list[int] = field(default_factory=list)
    per_step_drafted: list[int] = field(default_factory=list)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.per_step_drafted.append(num_drafted)
        self.per_step_accepted.append(num_accepted)

    @property
    def num_steps(self) -> int:
        return len(self.per_step_accepted)

    @property
    def num_accepted(self) -> int:
        return sum(self.per_step_accepted)

    @property
    def num_drafted(self) -> int:
        return sum(self.per_step_drafted)

    def histogram(self) -> list[int]:
        """Index j: verify steps that accepted exactly j drafts (bonus token excluded)."""
        counts = [0] * (self.num_spec_tokens + 1)
        for accepted in self.per_step_accepted:
            counts[accepted] += 1
        return counts


@dataclass
class RequestMetrics:
    """Monotonic timestamps of one request plus its speculation stats (None: no drafter)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0
    spec: SpecDecodeStats | None = None


@dataclass
class RequestOutput:
    """What one engine step produced for one request (deltas since the previous output)."""

    request_id: str
    text_delta: str
    token_ids_delta: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    metrics: RequestMetrics
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs_delta: list[TokenLogprob] | None = None  # one per token_ids_delta entry, if asked
    # In the first output only, when asked for: one per prompt token after the first.
    prompt_logprobs: list[TokenLogprob] | None = None


class Detokenizer(Protocol):
    """Turns appended token ids into newly complete text (see engine.tokenizer)."""

    def push(self, token_ids: Seq[int]) -> str: ...


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request's mutable state; touched only by the engine's step thread."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        detokenizer: Detokenizer,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        arrival_time: float,
        num_spec_tokens: int | None = None,
        adaptive: bool = False,
        bad_words_token_ids: tuple[tuple[int, ...], ...] = (),
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.output_token_ids: list[int] = []
        self.status = SequenceStatus.WAITING
        self.slot: int | None = None
        self.finish_reason: FinishReason | None = None
        # What stopped it, as vLLM reports it: the stop string, the stop token id, or None.
        self.stop_reason: str | int | None = None
        self.abort_requested = False
        self.text = ""
        self._detokenizer = detokenizer
        # Token ids that end the output.
        self.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else eos_token_ids
        )
        # What min_tokens holds back: EOS even with ignore_eos, as vLLM.
        self.min_tokens_stop_ids = frozenset(params.stop_token_ids) | eos_token_ids
        self.bad_words_token_ids = bad_words_token_ids  # params.bad_words, tokenized
        self.logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
        self.prompt_logprobs: list[TokenLogprob] | None = None  # set at prefill, if asked
        room = max_model_len - len(prompt_token_ids)
        self._max_len = room if params.max_tokens is None else min(params.max_tokens, room)
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        self._sent_tokens = 0
        self._sent_chars = 0
        spec = None if num_spec_tokens is None else SpecDecodeStats(num_spec_tokens, adaptive)
        self.metrics = RequestMetrics(arrival_time=arrival_time, spec=spec)

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1]

    @property
    def position(self) -> int:
        """Tokens in the slot's target cache: all but the last committed token."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) - 1

    @property
    def tokens_left(self) -> int:
        """The most tokens it may still generate (max_tokens, or the context limit)."""
        return max(0, self._max_len - len(self.output_token_ids))

    def finish(self, reason: FinishReason, now: float) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.metrics.finished_time = now

    def append(
        self, token_ids: Seq[int], now: float, logprobs: Seq[TokenLogprob] | None = None
    ) -> int:
        """Commit a step's tokens (and their logprobs, when asked for), stopping at the
        first stop condition; returns how many were kept (the rest, speculated past the
        stop, are dropped)."""
        if self.finished or not token_ids:
            return 0
        kept = self._append_tokens(token_ids)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.extend(logprobs[:kept])
        metrics = self.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        metrics.num_output_tokens = len(self.output_token_ids)
        if self.finish_reason is not None:
            self.metrics.finished_time = now
        return kept

    def _append_tokens(self, token_ids: Seq[int]) -> int:
        if not self.params.stop:
            return self._append_without_stop_strings(token_ids)
        # Stop strings: text is checked after every token so no token past the one that
        # completed a stop string is kept.
        for kept, token in enumerate(token_ids, start=1):
            if self._append_one(token):
                return kept
        return len(token_ids)

    def _append_without_stop_strings(self, token_ids: Seq[int]) -> int:
        room = self._max_len - len(self.output_token_ids)
        window = list(token_ids[:room])
        cut = next((i for i, t in enumerate(window) if t in self.stop_ids), None)
        if cut is not None:
            window = window[: cut + 1]
            self.output_token_ids.extend(window)
            self.text += self._detokenizer.push(window[:-1])
            self._set_finished("stop", self._stop_token_reason(window[-1]))
            return len(window)
        self.output_token_ids.extend(window)
        self.text += self._detokenizer.push(window)
        if len(self.output_token_ids) >= self._max_len:
            self._set_finished("length")
        return len(window)

    def _append_one(self, token: int) -> bool:
        """Append one token; True when the sequence finished on it."""
        self.output_token_ids.append(token)
        if token in self.stop_ids:
            self._set_finished("stop", self._stop_token_reason(token))
            return True
        old_len = len(self.text)
        self.text += self._detokenizer.push((token,))
        # As vLLM: stop strings count only once the output is longer than min_tokens.
        if len(self.output_token_ids) > self.params.min_tokens and self._truncate_at_stop_string(
            old_len
        ):
            self._set_finished("stop")
            return True
        if len(self.output_token_ids) >= self._max_len:
            self._set_finished("length")
            return True
        return False

    def _truncate_at_stop_string(self, old_len: int) -> bool:
        start = max(0, old_len - self._holdback)
        hits = [(i, s) for s in self.params.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        at, stop = min(hits)
        self.text = self.text[: at + len(stop) if self.params.include_stop_str_in_output else at]
        self.stop_reason = stop
        return True

    def _stop_token_reason(self, token: int) -> int | None:
        """vLLM's stop_reason for a stop token: the id for a requested stop token id,
        None for EOS."""
        return token if token in self.params.stop_token_ids else None

    def _set_finished(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        # The timestamp is set by `append`, which knows the step's time.
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        if stop_reason is not None:
            self.stop_reason = stop_reason

    def take_output(self) -> RequestOutput | None:
        """Everything new since the last call, or None when there is nothing to say.
        While running, text that could still become a stop string is held back."""
        end = len(self.text) if self.finished else max(0, len(self.text) - self._holdback)
        end = max(end, self._sent_chars)
        first = self._sent_tokens == 0 and self._sent_chars == 0
        tokens = self.output_token_ids[self._sent_tokens :]
        logprobs = None if self.logprobs is None else self.logprobs[self._sent_tokens :]
        text = self.text[self._sent_chars : end]
        if not tokens and not text and not self.finished:
            return None
        self._sent_tokens = len(self.output_token_ids)
        self._sent_chars = end
        return RequestOutput(
            request_id=self.request_id,
            text_delta=text,
            token_ids_delta=tokens,
            finished=self.finished,
            finish_reason=self.finish_reason,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_output_tokens=len(self.output_token_ids),
            metrics=self.metrics,
            stop_reason=self.stop_reason,
            logprobs_delta=logprobs,
            prompt_logprobs=self.prompt_logprobs if first else None,
        )


def slot_of(seq: Sequence) -> int:
    """A scheduled sequence's cache slot."""
    assert seq.slot is not None, "a scheduled sequence has a slot"
    return seq.slot
